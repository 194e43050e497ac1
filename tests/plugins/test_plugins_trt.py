"""decodert plugins on TensorRT: TensorRT-RTX parses and builds graphs with decodert plugin nodes
(CPU, in a child process: see the loader note below), registration refuses a parser that would
abort, and (-m gpu) engines with plugin layers run the Triton kernels and match ONNX Runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from decodert.errors import DecodertError
from kernel_cases import cuda_available

# ---------------------------------------------------------------- TensorRT-RTX
_TRT_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from tiny import make_tiny_checkpoint
    from decodert.errors import DecodertError
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model
    from decodert.plugins.trt.compat import load_trt
    from decodert.plugins.trt.creators import register_plugins
    tmp, result = Path({tmp!r}), {{}}
    trt, info = load_trt(need_builder=True)
    out = tmp / "llama"
    export_model(make_tiny_checkpoint("llama", tmp / "ck-llama"), out, target="trt", dtype="fp16", max_seq=64,
                 max_batch=2, progress=False, plugins="always")
    logger = trt.Logger(trt.Logger.ERROR)
    try:  # before registration: the parser names the plugin node it cannot import
        trt_build.parse_onnx(trt, trt.Builder(logger), logger, out / "decode.onnx")
    except DecodertError as e:
        result["unregistered"] = str(e)
    result["registered"] = register_plugins(trt, info)
    result["llama"] = {{k: dict(r.layers) for k, r in trt_build.build_engines(out, progress=False).items()}}
    out = tmp / "qwen3"
    export_model(make_tiny_checkpoint("qwen3", tmp / "ck-qwen3"), out, target="trt", dtype="fp32", max_seq=32,
                 max_batch=2, progress=False, plugins="always")
    result["qwen3"] = {{k: dict(r.layers) for k, r in trt_build.build_engines(out, progress=False).items()}}
    print("RESULT" + json.dumps(result))
""")


@pytest.mark.trt
def test_tensorrt_rtx_parses_and_builds_plugin_graphs(tmp_path):
    """Registered decodert plugins: TensorRT-RTX parses plugin nodes and builds engines on CPU.

    Runs in a child process with LD_LIBRARY_PATH naming a libtensorrt_rtx.so link: TensorRT-RTX
    1.7's parser dlopens that unversioned name when it imports a plugin node (the wheel ships only
    libtensorrt_rtx.so.1) and aborts the process when it is missing (docs/PLUGINS.md).
    """
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed: pip install "
                        "tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings")
    from decodert.plugins.trt.creators import rtx_alias_dir

    env = {**os.environ, "LD_LIBRARY_PATH": f"{rtx_alias_dir(tmp_path)}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    script = _TRT_SCRIPT.format(tests=str(Path(__file__).parents[1] / "helpers"), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT"):])
    assert "node '/model/layers.0/input_norm/RMSNorm' (RMSNorm)" in res["unregistered"]
    assert "decodert::CachedAttention" in res["registered"] and "::RMSNorm" in res["registered"]
    for family, per_layer in (("llama", 3), ("qwen3", 5)):  # attention + 2 norms (+ q/k norms)
        for kind, layers in res[family].items():
            assert layers["PLUGIN_V3"] == 2 * per_layer + 1, (family, kind, layers)  # 2 layers + final norm
            assert "KV_CACHE_UPDATE" not in layers and "ROTARY_EMBEDDING" not in layers


@pytest.mark.trt
def test_plugin_registration_refuses_a_parser_that_would_abort(monkeypatch, tmp_path):
    """Without the libtensorrt_rtx.so link, registering refuses with the fix instead of letting the
    parser abort the process later; with it, registration succeeds."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    import ctypes

    from decodert.plugins.trt.compat import load_trt
    from decodert.plugins.trt import creators as trt_plugins

    trt, info = load_trt()
    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path))
    libs = Path(__import__("tensorrt_rtx_libs").__file__).parent
    try:
        ctypes.CDLL("libtensorrt_rtx.so")
        linked = True
    except OSError:
        linked = (libs / "libtensorrt_rtx.so").exists()
    if linked:
        assert "decodert::RMSNorm" in trt_plugins.register_plugins(trt, info)
    else:
        with pytest.raises(DecodertError, match=f"LD_LIBRARY_PATH={tmp_path}/trt-rtx-alias"):
            trt_plugins.register_plugins(trt, info)
        link = tmp_path / "trt-rtx-alias" / "libtensorrt_rtx.so"
        assert link.resolve() == (libs / "libtensorrt_rtx.so.1").resolve()



_GPU_SCRIPT = textwrap.dedent("""
    import json, shutil, sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, {tests!r})
    from tiny import make_tiny_checkpoint
    from parity import backend
    from decodert.export import trt_build
    from decodert.artifact.manifest import load_manifest
    from decodert.export.pipeline import export_model
    from decodert.plugins.trt.compat import load_trt
    from decodert.export.artifact.expand_artifact import expand_artifact
    from decodert.plugins.trt.creators import register_plugins
    from decodert.runtime.backends.trt.backend import TrtBackend
    tmp = Path({tmp!r})
    register_plugins(*load_trt())  # before deserializing: the engines hold plugin layers
    out, ref = tmp / "trt", tmp / "ref"
    export_model(make_tiny_checkpoint("llama", tmp / "ck"), out, target="trt", dtype="fp16", max_seq=64,
                 max_batch=2, progress=False, plugins="always")
    shutil.copytree(out, ref)
    expand_artifact(ref)
    trt_build.build_engines(out, progress=False)
    prompts = [np.array([5, 6, 7, 8, 9, 10, 11]), np.array([12, 13, 14])]
    rows, fed = [], []
    for be in (backend(ref), TrtBackend(out, load_manifest(out))):
        cache = be.allocate(2)
        step = be.prefill(cache, [0, 1], prompts, want_logits=True)
        got = [step.logits.tolist()]
        for i in range(6):  # both fed ONNX Runtime's tokens
            if len(fed) < 6:
                fed.append(step.next_token.copy())
            step = be.decode(cache, [0, 1], fed[i], want_logits=True)
            got.append(step.logits.tolist())
        rows.append(got)
    ref_logits, trt_logits = (np.array(r, np.float32) for r in rows)
    print("RESULT" + json.dumps(float(np.abs(ref_logits - trt_logits).max() / np.abs(ref_logits).max())))
""")


@pytest.mark.gpu
@pytest.mark.trt
@pytest.mark.skipif(not cuda_available(), reason="needs an NVIDIA GPU (TensorRT engines with Triton plugin kernels)")
def test_tensorrt_plugin_engines_match_onnxruntime(tmp_path):
    """Prefill + 6 decode steps through TensorRT engines whose attention/norms are decodert plugins
    (Triton kernels) == ONNX Runtime on the expanded graphs, both fed ONNX Runtime's tokens."""
    from decodert.plugins.trt.creators import rtx_alias_dir

    env = {**os.environ, "LD_LIBRARY_PATH": f"{rtx_alias_dir(tmp_path)}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    script = _GPU_SCRIPT.format(tests=str(Path(__file__).parents[1] / "helpers"), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT"):]) < 2e-2
