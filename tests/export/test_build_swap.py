"""`decodert build` swaps the whole artifact folder (hard links + export/destination.swap_in):
interrupted or SIGKILLed at an engine rename, at the manifest write or at the swap, the folder
holds the old engines and manifest byte for byte, or the new complete set."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


from decodert.export.artifact import destination  # noqa: E402
from decodert.artifact.manifest import load_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A trt artifact with engines built once, and its files' hashes."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    import trt_graphs

    from decodert.export.trt_build import build_engines

    art = trt_graphs.write_artifact(tmp_path_factory.mktemp("build") / "trt", "fp16")
    build_engines(art, progress=False)
    return art, _tree(art)


def _tree(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _fresh(built, tmp_path):
    """A copy of the built artifact (hard links would share inodes with the fixture)."""
    import shutil

    art = shutil.copytree(built[0], tmp_path / "trt")
    return art, _tree(art)


KILL = textwrap.dedent("""
    import os, signal, sys
    from decodert.export.artifact import destination
    from decodert.export import trt_build
    where, n, art = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    obj, name = {"engine-rename": (os, "replace"), "manifest": (trt_build, "write_manifest"),
                 "exchange": (destination, "_exchange")}[where]
    real, calls = getattr(obj, name), []
    def fake(*a):
        calls.append(a)
        result = real(*a)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(obj, name, fake)
    trt_build.build_engines(art, progress=False, max_batch=1)
""")


# os.replace calls of a build: 1-2 the staged engines, 3-4 the engines renamed into place (where an
# in-place build left new engines beside the old manifest), 5 the manifest; then the exchange.
@pytest.mark.parametrize("where,n", [("engine-rename", 1), ("engine-rename", 3), ("engine-rename", 4),
                                     ("manifest", 1), ("exchange", 1)])
def test_sigkill_during_build_leaves_old_or_new(built, tmp_path, where, n):
    art, before = _fresh(built, tmp_path)
    proc = subprocess.run([sys.executable, "-c", KILL, where, str(n), str(art)], capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    destination.recover(art)  # the next export/build does this first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trt"]
    manifest = load_manifest(art, verify="full")
    if where == "exchange":  # past the commit point: the new engines (max_batch 1), complete
        assert manifest.engines["decode"].max_batch == 1
    else:
        assert _tree(art) == before  # the old engines and manifest, byte for byte


def test_interrupt_at_each_step_of_a_build(built, tmp_path, monkeypatch):
    from decodert.export import trt_build

    art, before = _fresh(built, tmp_path)
    for obj, name in ((os, "replace"), (trt_build, "write_manifest"), (destination, "_exchange")):
        real = getattr(obj, name)

        def fake(*a, real=real):
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(obj, name, fake)
            with pytest.raises(KeyboardInterrupt):
                trt_build.build_engines(art, progress=False, max_batch=1)
        assert _tree(art) == before and sorted(p.name for p in tmp_path.iterdir()) == ["trt"], name
    trt_build.build_engines(art, progress=False, max_batch=1)
    assert load_manifest(art, verify="full").engines["decode"].max_batch == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trt"]
