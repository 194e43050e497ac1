"""Weight-stripped TensorRT engines (export/trt_build.py, runtime/backends/trt/refit.py), as far as a machine
without a GPU allows: the flags reach the builder, CPU builds fall back to self-contained engines and
say why, the refit at load calls TensorRT's refitter and turns every failure into one line."""

import subprocess
import sys
from types import SimpleNamespace

import pytest


from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.backends.trt.refit import refit_from_onnx  # noqa: E402

trt = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")


@pytest.fixture
def trt_art(tmp_path):
    import trt_graphs

    return trt_graphs.write_artifact(tmp_path / "trt", "fp16")


def test_strip_flags_reach_the_builder_config():
    from decodert.export.trt_build import make_config
    from decodert.plugins.trt.compat import load_trt

    trt_mod, info = load_trt(need_builder=True)
    builder = trt_mod.Builder(trt_mod.Logger(trt_mod.Logger.ERROR))
    network = builder.create_network(1 << int(trt_mod.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    x = network.add_input("x", trt_mod.float16, (-1, 8))
    network.mark_output(network.add_identity(x).get_output(0))
    shapes = {"x": ([1, 8], [2, 8], [4, 8])}
    for strip in (True, False):
        config = make_config(trt_mod, info, builder, network, shapes, {"version_compatible": False, "strip": strip})
        assert config.get_flag(trt_mod.BuilderFlag.STRIP_PLAN) == strip
        assert config.get_flag(trt_mod.BuilderFlag.REFIT_IDENTICAL) == strip


def test_cpu_build_embeds_the_weights_and_says_why(trt_art):
    from decodert.artifact.manifest import load_manifest
    from decodert.export.trt_build import strip_problem
    from decodert.plugins.cuda_mem import gpu_count

    if gpu_count():
        pytest.skip("a GPU is visible: engines are stripped here")
    assert "only with a GPU present" in strip_problem(trt)
    res = subprocess.run([sys.executable, "-m", "decodert", "build", str(trt_art), "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "weights embedded)" in res.stdout and "weights embedded in each engine: TensorRT builds refittable" in res.stdout
    assert "engines " in res.stdout and "+ weights.bin" in res.stdout
    engines = load_manifest(trt_art).engines
    assert engines and not any(rec.weights_stripped for rec in engines.values())


def test_a_stripped_build_that_fails_suggests_self_contained(trt_art, monkeypatch):
    """Pretend stripping is possible: TensorRT-RTX 1.7 without a GPU then fails the refittable build (its
    JIT needs CUDA), which proves the flags reached the build; the error names the way out."""
    from decodert.export import trt_build
    from decodert.plugins.cuda_mem import gpu_count

    if gpu_count():
        pytest.skip("with a GPU the stripped build succeeds")
    monkeypatch.setattr(trt_build, "strip_problem", lambda trt_mod: None)
    with pytest.raises(DecodertError, match="--self-contained"):
        trt_build.build_engines(trt_art, progress=False)
    assert not trt_build.load_manifest(trt_art).engines  # nothing half-built was recorded
    engines = trt_build.build_engines(trt_art, progress=False, self_contained=True)
    assert not any(rec.weights_stripped for rec in engines.values())


# -- the refit at load, against a recording stand-in for TensorRT (no GPU here) -------------------
class _Parser:
    def __init__(self, refitter, logger, ok=True):
        self.refitter, self.ok, self.num_errors = refitter, ok, 0 if ok else 1

    def refit_from_file(self, path):
        self.refitter.calls.append(("refit_from_file", path))
        return self.ok

    def get_error(self, i):
        return SimpleNamespace(desc=lambda: "initializer 'w' has the wrong size")


class _Refitter:
    def __init__(self, engine, logger, apply_ok=True):
        self.calls, self.apply_ok = engine, apply_ok

    def refit_cuda_engine(self):
        self.calls.append(("refit_cuda_engine",))
        return self.apply_ok

    def get_missing_weights(self):
        return ["layers.0.qkv"]


def _fake_trt(parse_ok=True, apply_ok=True):
    return SimpleNamespace(Refitter=lambda e, log: _Refitter(e, log, apply_ok),
                           OnnxParserRefitter=lambda r, log: _Parser(r, log, parse_ok))


def test_refit_from_onnx_calls_the_refitter_in_order(tmp_path):
    graph = tmp_path / "decode.onnx"
    graph.write_bytes(b"onnx")
    calls = []
    refit_from_onnx(_fake_trt(), calls, graph, None, tmp_path / "decode.engine")
    assert calls == [("refit_from_file", str(graph)), ("refit_cuda_engine",)]
    with pytest.raises(DecodertError, match="refitting the weights from decode.onnx failed: initializer 'w'"):
        refit_from_onnx(_fake_trt(parse_ok=False), [], graph, None, tmp_path / "decode.engine")
    with pytest.raises(DecodertError, match="1 weights missing, e.g. layers.0.qkv"):
        refit_from_onnx(_fake_trt(apply_ok=False), [], graph, None, tmp_path / "decode.engine")
    with pytest.raises(DecodertError, match="has no OnnxParserRefitter; rebuild it with `decodert build --self-contained`"):
        refit_from_onnx(SimpleNamespace(), [], graph, None, tmp_path / "decode.engine")
    with pytest.raises(DecodertError, match="graph prefill.onnx is missing"):
        refit_from_onnx(_fake_trt(), [], tmp_path / "prefill.onnx", None, tmp_path / "prefill.engine")
