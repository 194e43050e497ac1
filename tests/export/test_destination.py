"""`decodert export -o DIR`: what may be replaced, and a swap that leaves the old artifact or the
new one (never none) when interrupted or killed at any rename (export/artifact/destination.py)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
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


def _marked(parent: Path, name: str, kind: str, pid: int, token: str | None = None) -> Path:
    """A folder as decodert makes one beside artifact ``name``: ``.NAME.tmp-PID-XXXXXXXX`` holding its marker."""
    token = token or secrets.token_hex(16)
    folder = parent / f".{name}.{kind}-{pid}-{token[:8]}"
    folder.mkdir()
    (folder / destination.MARKER).write_text(json.dumps({"pid": pid, "token": token}))
    return folder


def test_recover_keeps_live_and_foreign_folders(tmp_path):
    out, dead, live = tmp_path / "out", _dead_pid(), os.getppid()
    stale = _marked(tmp_path, "out", "tmp", dead)
    moved = _marked(tmp_path, "out", "old", dead)
    (moved / "manifest.json").write_text(json.dumps({"format": "decodert-artifact"}))
    kept = [_marked(tmp_path, "out", "tmp", live).name, _marked(tmp_path, "other", "tmp", dead).name]
    for name in (f".out.tmp-{dead}-ab12cd34", f".out.old-{dead}-ab12cd34", f".out.old-{dead}", ".out.tmp-x"):
        (tmp_path / name).mkdir()  # named like ours, but no marker: a user's folder
    kept += [f".out.tmp-{dead}-ab12cd34", f".out.old-{dead}-ab12cd34", f".out.old-{dead}", ".out.tmp-x"]
    wrong = _marked(tmp_path, "out", "tmp", dead)  # a marker that does not name this folder
    (wrong / destination.MARKER).write_text(json.dumps({"pid": dead, "token": secrets.token_hex(16)}))
    kept.append(wrong.name)
    destination.recover(out)  # out is missing: the moved-aside old artifact is put back, without its marker
    assert _siblings(out) == sorted([*kept, "out"])
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] and not stale.exists()
    moved = _marked(tmp_path, "out", "old", dead)
    destination.recover(out)  # out is there: a moved-aside copy is deleted
    assert not moved.exists() and _siblings(out) == sorted([*kept, "out"])


def test_a_users_folder_named_like_a_temp_folder_survives_refused_and_accepted_exports(old, samples, capsys):
    """Only folders holding decodert's marker are removed, and only once an export is accepted."""
    out, _ = old
    dead = _dead_pid()
    users = [out.with_name(f".out.tmp-{dead}-ab12cd34"), out.with_name(f".out.old-{dead}-ab12cd34"),
             out.with_name(f".out.old-{dead}")]
    for folder in users:
        folder.mkdir()
        (folder / "thesis.tex").write_text("precious")
    (users[2] / "manifest.json").write_text(json.dumps({"format": "decodert-artifact"}))
    stale = _marked(out.parent, "out", "tmp", dead)
    (stale / "weights.bin").write_bytes(b"half-written")
    assert cli_main(["export", str(samples["hf"]), "-o", str(out), "--max-seq", "32"]) == 2
    assert "add --force" in capsys.readouterr().err
    assert stale.is_dir() and _siblings(out) == sorted([stale.name, "out", *(f.name for f in users)])
    assert cli_main(["export", str(samples["hf"]), "-o", str(out), "--max-seq", "32", "--force"]) == 0
    assert not stale.exists() and _siblings(out) == sorted(["out", *(f.name for f in users)])
    assert all((f / "thesis.tex").read_text() == "precious" for f in users)
    manifest = load_manifest(out, verify="full")
    assert manifest.max_seq == 32 and destination.MARKER not in manifest.files
    assert not (out / destination.MARKER).exists()


SIGNALLED = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as on a terminal, even when the tests run under nohup
    from decodert.cli import main
    from decodert.export import pipeline
    src, out = sys.argv[1], sys.argv[2]
    real = pipeline._write_graphs
    def slow(*args, **kwargs):  # the weights are written: stop here until signalled
        Path(out + ".ready").write_text("")
        time.sleep(120)
        return real(*args, **kwargs)
    pipeline._write_graphs = slow
    sys.exit(main(["export", src, "-o", out, "--max-seq", "32"]))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_mid_export_removes_the_temp_folder(samples, tmp_path, sig):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED, str(samples["hf"]), str(out)], stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "out.ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        temp = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
        assert len(temp) == 1 and (temp[0] / "weights.bin").is_file()  # half-way: the weights are there
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert err.count("\n") == 1 and signal.Signals(sig).name in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.ready"]
