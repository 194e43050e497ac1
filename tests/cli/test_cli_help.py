"""What `decodert COMMAND --help` promises (issue 31): every option described, defaults named, the
quantization rule of `run --quant auto` as export/checkpoints/source_precision.py applies it."""

from __future__ import annotations

import pytest

from decodert.cli import build_parser


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return " ".join(sub.format_help().split())  # argparse wraps lines


def _options_without_help(command: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return [a.option_strings[0] for a in sub._actions if a.option_strings and not a.help]


@pytest.mark.parametrize("command", ["export", "inspect", "build", "generate", "chat", "run", "serve", "verify", "bench"])
def test_every_option_has_help_and_every_command_a_description(command):
    assert _options_without_help(command) == []
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    assert sub.description, f"`decodert {command} --help` has no description"


def test_export_help_names_the_defaults():
    text = _help("export")
    for flag, default in (("--target", "default ort"), ("--dtype", "default fp32"), ("--max-batch", "default 4")):
        assert default in text.split(flag, 2)[-1], flag


def test_run_help_says_a_q4_1_gguf_becomes_fp32():
    from decodert.export.checkpoints.source_precision import POLICY

    assert POLICY["Q4_1"][0] is None  # the rule the help describes: Q4_1 is exported as fp32
    text = _help("run")
    assert "Q4_1 GGUF and float weights become fp32" in text and "Q4_1/Q8_0 GGUF stays" not in text


def test_export_onto_an_artifact_needs_force(tiny_checkpoint, tmp_path, capsys):
    from decodert.cli import main

    out = tmp_path / "out"
    src = str(tiny_checkpoint("llama"))
    assert main(["export", src, "-o", str(out), "--max-seq", "32"]) == 0
    before = (out / "manifest.json").read_bytes()
    capsys.readouterr()
    assert main(["export", src, "-o", str(out), "--max-seq", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and "--force" in err and len(err.strip().splitlines()) == 1
    assert (out / "manifest.json").read_bytes() == before  # nothing lost
    assert main(["export", src, "-o", str(out), "--max-seq", "64", "--force"]) == 0
    assert "replacing the artifact" in capsys.readouterr().err and (out / "manifest.json").read_bytes() != before


def test_export_and_inspect_describe_the_quantization(tiny_checkpoint, tmp_path, capsys):
    """Accuracy level 4 computes with int8 activations (not fp32); inspect shows bits, block, level and zero points."""
    from decodert.cli import main

    out = tmp_path / "q"
    assert main(["export", str(tiny_checkpoint("llama")), "-o", str(out), "--max-seq", "32", "--quant", "int4",
                 "--accuracy-level", "4", "--block-size", "16", "--symmetric"]) == 0
    text = capsys.readouterr().out
    assert "weights int4 (int8 activations, accuracy level 4)" in text and "fp32 compute" not in text
    assert main(["inspect", str(out)]) == 0
    quant = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("quant "))
    for part in ("int4", "int8 activations, accuracy level 4", "block 16", "symmetric", "rounded"):
        assert part in quant, quant
    assert main(["export", str(tiny_checkpoint("llama")), "-o", str(tmp_path / "f"), "--max-seq", "32"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "f")]) == 0
    assert "quant      none (fp32 weights)" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "chat", "run"])
@pytest.mark.parametrize("flags,message", [
    (["--json-schema", "/dev/null"], "--json-schema /dev/null is empty"),
    (["--json-schema", "SCHEMA"], "--json-schema: invalid JSON schema"),
    (["--json-schema", "NOTJSON"], "--json-schema: json_schema is not valid JSON"),
    (["--json-schema", "DEEP"], "--json-schema: json_schema is nested too deeply"),
    (["--regex", "(a"], "--regex: invalid regex"),
    (["--grammar", "GRAMMAR"], "--grammar: invalid Lark grammar"),
    (["--grammar", "MISSING"], "cannot read --grammar"),
])
def test_structured_output_inputs_fail_before_loading(command, flags, message, tmp_path, monkeypatch, capsys):
    from decodert.cli import common, main
    from decodert.export import prepare

    files = {"SCHEMA": '{"type": "nonsense"}', "NOTJSON": "{", "GRAMMAR": "x ::= ", "DEEP": '{"items": ' * 2000 + "{}" + "}" * 2000}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    flags = [str(tmp_path / f) if f in files or f == "MISSING" else f for f in flags]
    loads = []
    monkeypatch.setattr(common, "load", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(prepare, "prepare_model", lambda *a, **k: loads.append(a))
    prompt = ["--prompt", "hi"] if command != "chat" else []
    assert main([command, str(tmp_path), *prompt, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert loads == []  # nothing was exported or loaded
