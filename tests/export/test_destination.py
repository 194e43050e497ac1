"""`decodert export -o DIR`: what may be replaced, and a swap that leaves the old artifact or the
new one (never none) when interrupted or killed at any rename (export/artifact/destination.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from decodert.cli import main as cli_main
from decodert.errors import DecodertError
from decodert.artifact import artifact_files
from decodert.export.artifact import destination
from decodert.artifact.manifest import load_manifest
from decodert.export.pipeline import export_model

ROOT = Path(__file__).resolve().parents[3]  # the folder holding the decodert package


def _export(src, out, max_seq=64):
    return export_model(src, out, max_seq=max_seq, max_batch=1, progress=False)


def _tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def old(samples, tmp_path):
    """An artifact at tmp_path/out (max_seq 64) and its files' hashes."""
    out = tmp_path / "out"
    _export(samples["hf"], out)
    return out, _tree(out)


# -- what may be replaced ----------------------------------------------------------------------
def test_a_foreign_manifest_is_not_replaced(samples, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "manifest.json").write_text('{"name": "app"}')
    (site / "notes.txt").write_text("precious")
    with pytest.raises(DecodertError, match="not a decodert artifact"):
        _export(samples["hf"], site)
    assert _siblings(site) == ["site"] and (site / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("extra", ["notes.txt", "sub/"])
def test_an_artifact_with_other_files_is_not_replaced(old, extra, samples, capsys):
    out, before = old
    if extra.endswith("/"):
        (out / extra).mkdir()
    else:
        (out / extra).write_text("mine")
    assert cli_main(["export", str(samples["hf"]), "-o", str(out), "--max-seq", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and extra in err and "not part of the decodert artifact" in err
    assert {k: v for k, v in _tree(out).items() if k != extra.rstrip("/")} == before


def test_an_artifact_and_an_empty_folder_are_replaced(old, samples, tmp_path):
    out, _ = old
    (out / ".manifest.json.tmp").write_text("left by an interrupted write")  # staged files belong to it
    assert _export(samples["hf"], out, max_seq=32).max_seq == 32
    assert load_manifest(out, verify="full").max_seq == 32 and _siblings(out) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    _export(samples["hf"], empty)
    assert load_manifest(empty).max_seq == 64


def test_bad_destinations_are_one_line_errors(samples, tmp_path, monkeypatch, capsys):
    src = str(samples["hf"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    for out in (".", str(tmp_path.parent), "/", "/proc/decodert-test", "file", "file/sub"):
        assert cli_main(["export", src, "-o", out]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith("decodert: error: -o ") and err.count("\n") == 1, err
    assert cli_main(["export", src, "-o", "x", "--max-seq", "0"]) == 2
    assert "--max-seq must be an integer >= 2" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert cli_main(["export", src, "-o", "a/sub/..", "--max-seq", "32"]) == 0  # the same as -o a
    assert load_manifest(tmp_path / "a").max_seq == 32 and sorted(p.name for p in tmp_path.iterdir()) == ["a", "file"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_artifact_modes_follow_the_umask(samples, tmp_path, umask):
    previous = os.umask(umask)
    try:
        out = tmp_path / "out"
        _export(samples["hf"], out)
        assert artifact_files.file_mode() == 0o666 & ~umask
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~umask}


# -- interrupted swaps -------------------------------------------------------------------------
def _fail_at(monkeypatch, obj, name, n, after, action):
    """Make the n-th call of obj.name run ``action`` before (or after) doing its real work."""
    real, calls = getattr(obj, name), []

    def fake(*args):
        calls.append(args)
        if len(calls) == n and not after:
            action()
        result = real(*args)
        if len(calls) == n and after:
            action()
        return result

    monkeypatch.setattr(obj, name, fake)
    return calls


def _interrupt():
    raise KeyboardInterrupt


# (swap mode, patched function, which call, after the real call?)
SWAP_POINTS = [("exchange", "_exchange", 1, False), ("exchange", "_exchange", 1, True),
               ("renames", "rename", 1, False), ("renames", "rename", 1, True),
               ("renames", "rename", 2, False), ("renames", "rename", 2, True)]


def _arrange(monkeypatch, mode, name, n, after, action):
    if mode == "renames":  # a kernel or file system without RENAME_EXCHANGE
        monkeypatch.setattr(destination, "_exchange", lambda a, b: False)
    return _fail_at(monkeypatch, destination if name == "_exchange" else os, name, n, after, action)


@pytest.mark.parametrize("mode,name,n,after", SWAP_POINTS)
def test_interrupt_at_each_rename_leaves_the_old_or_the_new_artifact(old, samples, monkeypatch, mode, name, n, after):
    out, before = old
    with monkeypatch.context() as m:
        _arrange(m, mode, name, n, after, _interrupt)
        with pytest.raises(KeyboardInterrupt):
            _export(samples["hf"], out, max_seq=32)
    assert _siblings(out) == ["out"]  # no temp or moved-aside folder left
    manifest = load_manifest(out, verify="full")
    swapped = (mode == "exchange" and after) or (n == 2 and after)
    assert manifest.max_seq == (32 if swapped else 64)
    if not swapped:
        assert _tree(out) == before


def test_a_failing_exchange_is_a_one_line_error(old, samples, monkeypatch):
    out, before = old

    def fail(a, b):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(destination, "_exchange", fail)
    with pytest.raises(DecodertError, match="cannot move the new artifact into place"):
        _export(samples["hf"], out, max_seq=32)
    assert _tree(out) == before and _siblings(out) == ["out"]


KILLED = textwrap.dedent("""
    import os, signal, sys
    from decodert.export.artifact import destination
    from decodert.export import pipeline
    mode, name, n, after, src, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], sys.argv[6]
    if mode == "renames":
        destination._exchange = lambda a, b: False
    obj = destination if name == "_exchange" else pipeline if name == "write_manifest" else os
    real, calls = getattr(obj, name), []
    def fake(*args):
        calls.append(1)
        if len(calls) == n and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args)
        if len(calls) == n and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(obj, name, fake)
    pipeline.export_model(src, out, max_seq=32, max_batch=1, progress=False)
""")


@pytest.mark.parametrize("mode,name,n,after", [("exchange", "write_manifest", 1, True), ("exchange", "_exchange", 1, True),
                                               ("renames", "rename", 1, True), ("renames", "rename", 2, True)])
def test_sigkill_at_a_rename_then_the_next_run_recovers(old, samples, mode, name, n, after):
    out, before = old
    proc = subprocess.run([sys.executable, "-c", KILLED, mode, name, str(n), "1" if after else "0",
                           str(samples["hf"]), str(out)],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                          capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert len(_siblings(out)) == 2  # a killed process leaves its temp or moved-aside folder
    destination.recover(out)  # what the next export does first (the killed PID is gone)
    assert _siblings(out) == ["out"]
    manifest = load_manifest(out, verify="full")
    if name == "_exchange" or (name == "rename" and n == 2 and after):
        assert manifest.max_seq == 32  # swapped: the new artifact is complete
    else:
        assert _tree(out) == before  # the old artifact, byte for byte


def test_recover_keeps_live_and_foreign_folders(tmp_path):
    out, dead, live = tmp_path / "out", _dead_pid(), os.getppid()
    for name in (f".out.tmp-{dead}-ab12", f".out.tmp-{live}-cd34", f".out.old-{dead}", ".out.tmp-x", ".other.tmp-1-ab"):
        (tmp_path / name).mkdir()
    (tmp_path / f".out.old-{dead}" / "manifest.json").write_text(json.dumps({"format": "decodert-artifact"}))
    destination.recover(out)  # out is missing: the moved-aside old artifact is put back
    assert _siblings(out) == [".other.tmp-1-ab", f".out.tmp-{live}-cd34", ".out.tmp-x", "out"]
    assert (out / "manifest.json").is_file()
    (tmp_path / f".out.old-{dead}").mkdir()
    destination.recover(out)  # out is there: a moved-aside copy is deleted
    assert f".out.old-{dead}" not in _siblings(out) and (out / "manifest.json").is_file()
