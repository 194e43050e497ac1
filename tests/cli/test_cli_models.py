"""Every command that takes an artifact takes what `decodert run` takes (issue 31): the name
'smollm2', a .gguf file, an HF folder or an artifact folder, a checkpoint exported once into the
cache; build and verify, which need a --target trt export, say what to run instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny import make_tiny_gguf  # noqa: E402

from decodert.cli import build_parser, main  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return make_tiny_gguf("llama", tmp_path_factory.mktemp("g") / "tiny-q4_0.gguf", "Q4_0")


def _exports(cache: Path) -> list[str]:
    folder = cache / "artifacts"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_generate_inspect_and_bench_take_a_checkpoint_and_export_it_once(tiny_checkpoint, cache, capsys):
    hf = str(tiny_checkpoint("llama"))
    assert main(["generate", hf, "--prompt", "hello", "--max-new-tokens", "3", "--greedy", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert len(_exports(cache)) == 1
    assert main(["inspect", hf]) == 0 and "target     ort" in capsys.readouterr().out
    assert main(["bench", hf, "--prompt-len", "4", "--gen", "4", "--repeats", "1", "--warmup", "0"]) == 0
    assert "1 repeat after" in capsys.readouterr().out
    assert len(_exports(cache)) == 1  # exported once, reused by every command


def test_serve_smollm2_resolves_the_name(gguf, cache, monkeypatch):
    from decodert.cli.serve import options
    from decodert.export import prepare

    monkeypatch.setattr(prepare, "smollm2_gguf", lambda: gguf)  # the named model without a download
    opts = options(build_parser().parse_args(["serve", "smollm2", "--speculative", "ngram"]))
    assert opts.artifact.is_dir() and opts.artifact.parent == cache / "artifacts" and (opts.artifact / "manifest.json").is_file()
    assert opts.model_name == "smollm2"
    again = options(build_parser().parse_args(["serve", "smollm2", "--model-name", "m"]))
    assert again.artifact == opts.artifact and again.model_name == "m" and len(_exports(cache)) == 1


@pytest.mark.parametrize("command", ["build", "verify"])
def test_build_and_verify_of_a_checkpoint_say_what_to_run(command, tiny_checkpoint, cache, capsys):
    hf = str(tiny_checkpoint("llama"))
    assert main([command, hf]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and len(err.strip().splitlines()) == 1
    assert f"decodert export {hf} -o OUT --target trt" in err and _exports(cache) == []


def test_a_wrong_name_is_still_one_line(cache, capsys, tmp_path):
    assert main(["generate", str(tmp_path / "smolm2"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and len(err.strip().splitlines()) == 1
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "nor a model `decodert run` takes" in capsys.readouterr().err
