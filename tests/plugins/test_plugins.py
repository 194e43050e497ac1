"""decodert ops defined once: reference bodies (ONNX Runtime) == numpy references, expansion,
--plugins exports vs transformers, TensorRT-RTX plugin registration + build, Triton kernels.

Random inputs are fresh each run (seed printed on failure; DECODERT_TEST_SEED=n repeats one).
Triton kernels run on CPU through TRITON_INTERPRET=1 in a child process (tests/helpers/kernel_cases.py);
the same cases run on CUDA under ``-m gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import kernel_cases
from seeds import RUN_SEED
from decodert.cli import main as cli_main
from decodert.errors import DecodertError
from decodert.artifact.manifest import load_manifest
from decodert.plugins.onnx_builder import DTYPES
from decodert.export.pipeline import export_model
from decodert.export.artifact.expand_artifact import expand_artifact
from decodert.plugins.expand import expand_plugin_nodes
from decodert.plugins.catalog import get_op, load_all
from decodert.plugins.registry import DOMAIN
from decodert.export.lowering.targets import ORT, TRT
from decodert.plugins.selection import choose_plugins
from decodert.plugins.ops.weight_gemm import dequantize_ref

SEED = RUN_SEED  # the run's seed (tests/helpers/seeds.py): $DECODERT_TEST_SEED, else drawn once
NP_TO_ONNX = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16"}


def _value_info(name: str, a: np.ndarray) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(a.dtype)
    return helper.make_tensor_value_info(name, elem, list(a.shape))


def run_op(op: str, inputs: list[tuple[str, np.ndarray, bool]], n_out: int, **attrs) -> list[np.ndarray]:
    """One decodert node (inputs: (name, array, is_initializer)), expanded, run by ONNX Runtime."""
    outs = [f"out{i}" for i in range(n_out)]
    node = helper.make_node(op, [n for n, _, _ in inputs], outs, name=f"/test/{op}", domain=DOMAIN, **attrs)
    feeds = {n: a for n, a, init in inputs if not init}
    graph = helper.make_graph([node], "t", [_value_info(n, a) for n, a, init in inputs if not init], [],
                              [numpy_helper.from_array(a, n) for n, a, init in inputs if init])
    opdef = get_op(op)
    elem = DTYPES[NP_TO_ONNX[inputs[opdef.type_input][1].dtype]]
    shapes = opdef.output_shapes([list(a.shape) for _, a, _ in inputs], opdef.check_attributes("t", attrs))
    graph.output.extend(helper.make_tensor_value_info(o, elem, shape) for o, shape in zip(outs, shapes))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    expanded = expand_plugin_nodes(model)
    assert all(n.domain != DOMAIN for n in expanded.graph.node)
    onnx.checker.check_model(expanded, full_check=True)
    sess = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(got, want, tol: float, what: str) -> None:
    scale = max(float(np.abs(want.astype(np.float32)).max()), 1.0)
    err = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max())
    assert got.shape == want.shape and err <= tol * scale, f"{what}: max err {err:.3g} (scale {scale:.3g}), seed {SEED}"


# ---------------------------------------------------------------- CachedAttention
ATTENTION_CASES = {**kernel_cases.ATTENTION, "prefill_gqa8_d128_fp16_window": (2, 7, 16, 2, 128, 40, 128, [0, 30], 12,
                                                                              "float16")}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_cached_attention_body_matches_numpy(case):
    b, s, h, hkv, d, smax, r, past, window, dtype = ATTENTION_CASES[case]
    rng = np.random.default_rng(SEED)
    rand = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    past_lengths = np.minimum(np.array(past) + rng.integers(0, 3, b), smax - s).astype(np.int64)  # ragged
    arrays = [("q", rand(b, s, h * d), False), ("k", rand(b, s, hkv * d), False), ("v", rand(b, s, hkv * d), False),
              ("past_key", rand(b, hkv, smax, d), False), ("past_value", rand(b, hkv, smax, d), False),
              ("past_lengths", past_lengths, False), ("cos", rand(smax, r // 2), True),
              ("sin", rand(smax, r // 2), True)]
    attrs = dict(num_heads=h, kv_num_heads=hkv, sliding_window=window)
    got = run_op("CachedAttention", arrays, 3, **attrs)
    want = get_op("CachedAttention").numpy_ref(*[a for _, a, _ in arrays], **attrs)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for name, g, w in zip(("y", "present_key", "present_value"), got, want):
        assert_close(g, w, tol, f"{case} {name}")
    shapes = get_op("CachedAttention").output_shapes([list(a.shape) for _, a, _ in arrays], attrs)
    assert shapes == [list(w.shape) for w in want]
    untouched = np.ones(smax, bool)
    for row, p in enumerate(past_lengths):  # only the new rows of the cache changed
        untouched[:] = True
        untouched[p : p + s] = False
        np.testing.assert_array_equal(got[1][row][:, untouched], arrays[3][1][row][:, untouched])


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("shape,fused,dtype", [((3, 5, 64), False, "float32"), ((7, 128), True, "float32"),
                                               ((2, 4, 8, 32), True, "float16"), ((6, 96), False, "float16")])
def test_rms_norm_body_matches_numpy(shape, fused, dtype):
    rng = np.random.default_rng(SEED)
    x, res, w = (rng.standard_normal(sh).astype(dtype) for sh in (shape, shape, shape[-1:]))
    arrays = [("x", x, False), ("weight", w, True)] + ([("residual", res, False)] if fused else [])
    got = run_op("RMSNorm", arrays, 2, epsilon=1e-5)
    want = get_op("RMSNorm").numpy_ref(x, w, res if fused else None, epsilon=1e-5)
    tol = 1e-5 if dtype == "float32" else 4e-3
    assert_close(got[0], want[0], tol, "y")
    assert_close(got[1], want[1], tol, "sum")  # x + residual, or x itself
    assert get_op("RMSNorm").output_shapes([list(shape), [shape[-1]]], {}) == [list(shape)] * 2


# ---------------------------------------------------------------- MatMulNBits
@pytest.mark.parametrize("bits,k,n,block,symmetric,a_shape", [
    (4, 128, 24, 32, False, (5,)), (4, 96, 10, 32, False, (2, 3)),  # odd block count: padded zero points
    (4, 256, 16, 128, True, (1,)), (8, 64, 12, 16, False, (4,)), (8, 128, 8, 64, True, (3, 2))])
def test_matmul_nbits_body_matches_numpy(bits, k, n, block, symmetric, a_shape):
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((n, k)).astype(np.float32)
    from decodert.export.quantize.quant import QuantConfig, quantize  # the one quantizer and packer

    qw = quantize(w, QuantConfig(bits=bits, block_size=block, symmetric=symmetric, scale_search=False))
    b, scales, zp = qw.q.reshape(n, k // block, block * bits // 8), qw.scales, qw.zero_points
    assert b.shape == (n, k // block, block * bits // 8) and scales.shape == (n, k // block)
    deq = dequantize_ref(b, scales, zp, K=k, N=n, bits=bits, block_size=block)
    assert np.abs(deq - w).max() <= scales.max() * (0.5 if not symmetric else 1.0) + 1e-6  # quantization error
    a = rng.standard_normal((*a_shape, k)).astype(np.float32)
    arrays = [("a", a, False), ("b", b, True), ("scales", scales, True)]
    arrays += [("zp", zp, True)] if zp is not None else []
    attrs = dict(K=k, N=n, bits=bits, block_size=block)
    got = run_op("MatMulNBits", arrays, 1, **attrs)
    want = get_op("MatMulNBits").numpy_ref(*[x for _, x, _ in arrays], **attrs)
    assert_close(got[0], want[0], 1e-5, "y")
    assert get_op("MatMulNBits").output_shapes([list(a.shape)], attrs) == [list(want[0].shape)]


def test_matmul_nbits_layout_is_onnxruntime_and_export_quant():
    """The same bytes through com.microsoft.MatMulNBits and export/quantize/quant.py's dequantize."""
    from decodert.export.quantize.quant import QuantConfig, dequantize, quantize

    rng = np.random.default_rng(SEED)
    k, n, block = 96, 10, 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    cfg = QuantConfig(bits=4, block_size=block)
    qw = quantize(w, cfg)
    b = qw.q.reshape(n, k // block, block // 2)
    np.testing.assert_allclose(dequantize_ref(b, qw.scales, qw.zero_points, K=k, N=n, bits=4, block_size=block),
                               dequantize(qw, cfg)[:, :k], atol=1e-6)
    a = rng.standard_normal((3, k)).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["a", "b", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block)
    graph = helper.make_graph([node], "t", [_value_info("a", a)], [helper.make_tensor_value_info("y", 1, [3, n])],
                              [numpy_helper.from_array(x, name) for x, name in ((b, "b"), (qw.scales, "s"),
                                                                                 (qw.zero_points, "z"))])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    want = get_op("MatMulNBits").numpy_ref(a, b, qw.scales, qw.zero_points, K=k, N=n, bits=4, block_size=block)[0]
    assert_close(y, want, 1e-5, "MatMulNBits")


# ---------------------------------------------------------------- expansion errors
def _one_node_model(node: onnx.NodeProto) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", 1, [2, 8])
    graph = helper.make_graph([node], "t", [x], [helper.make_tensor_value_info(node.output[0], 1, [2, 8])],
                              [numpy_helper.from_array(np.ones(8, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


@pytest.mark.parametrize("node,match", [
    (helper.make_node("FlashAttention", ["x"], ["y"], name="/m/fa", domain=DOMAIN),
     r"node /m/fa: unknown op decodert::FlashAttention"),
    (helper.make_node("RMSNorm", ["x", "w"], ["y"], name="/m/n1", domain=DOMAIN, epsilon=1e-5, gamma=2.0),
     r"node /m/n1: unknown attribute\(s\) \['gamma'\]"),
    (helper.make_node("CachedAttention", ["x"] * 8, ["y", "a", "b"], name="/m/att", domain=DOMAIN, num_heads=2),
     r"node /m/att: missing attribute\(s\) \['kv_num_heads'\]"),
    (helper.make_node("RMSNorm", ["x"], ["y"], name="/m/n2", domain=DOMAIN),
     r"node /m/n2: decodert::RMSNorm takes inputs"),
])
def test_expand_errors_name_the_node(node, match):
    with pytest.raises(DecodertError, match=match):
        expand_plugin_nodes(_one_node_model(node))


def test_registry_lists_every_op():
    assert set(load_all()) == {"CachedAttention", "RMSNorm", "MatMulNBits", "CausalConv", "GatedDeltaNet",
                              "Mamba2SSM"}
    assert all(op.body and op.shape_rule for op in load_all().values())


# ---------------------------------------------------------------- --plugins choice
def test_plugin_choice_per_tensorrt_version():
    assert choose_plugins("auto", TRT, "10.3")["ops"] == ["CachedAttention", "RMSNorm"]  # JetPack 6
    assert choose_plugins("auto", TRT, "10.13.3")["ops"] == ["CachedAttention", "RMSNorm"]  # JetPack 7.1
    assert choose_plugins("auto", TRT, "10.15")["ops"] == []
    assert choose_plugins("never", TRT, "10.3")["ops"] == []
    assert choose_plugins("always", TRT, "11.0")["ops"] == ["CachedAttention", "RMSNorm"]
    assert choose_plugins("auto", ORT) is None
    with pytest.raises(DecodertError, match="--target trt"):
        choose_plugins("always", ORT)
    with pytest.raises(DecodertError, match="not a TensorRT version"):
        choose_plugins("auto", TRT, "jetson")
    with pytest.raises(DecodertError, match="unknown --plugins"):
        choose_plugins("sometimes", TRT)


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path), load_external_data=False).graph


def test_export_plugins_always_writes_plugin_nodes(tiny_checkpoint, tmp_path):
    out = tmp_path / "a"
    assert cli_main(["export", str(tiny_checkpoint("llama")), "-o", str(out), "--target", "trt", "--plugins", "always",
                     "--max-seq", "64"]) == 0
    m = load_manifest(out)
    assert m.plugins.mode == "always" and m.plugins.ops == ("CachedAttention", "RMSNorm")
    layers = m.model.num_layers
    for kind in ("prefill", "decode"):
        graph = _graph(out / f"{kind}.onnx")
        ops = [n.op_type for n in graph.node]
        assert not {"TensorScatter", "RotaryEmbedding", "Attention", "RMSNormalization"} & set(ops)
        attn = [n for n in graph.node if n.op_type == "CachedAttention" and n.domain == DOMAIN]
        assert [list(n.output[1:]) for n in attn] == [[f"present_key.{i}", f"present_value.{i}"] for i in range(layers)]
        assert list(attn[0].input[3:6]) == ["past_key.0", "past_value.0", "past_lengths"]
        assert ops.count("RMSNorm") == 2 * layers + 1
    assert cli_main(["export", str(tiny_checkpoint("llama")), "-o", str(tmp_path / "b"), "--target", "trt",
                     "--trt-version", "10.3", "--max-seq", "64"]) == 0
    assert load_manifest(tmp_path / "b").plugins.ops == ("CachedAttention", "RMSNorm")  # auto for JetPack 6
    assert cli_main(["export", str(tiny_checkpoint("llama")), "-o", str(tmp_path / "c"), "--plugins", "always"]) == 2


@pytest.mark.parametrize("family", ["llama", "phi3", "mistral", "qwen3"])  # GQA, partial rotary, window, qk-norm
def test_plugin_export_expanded_matches_transformers(tiny_checkpoint, tmp_path, family):
    import torch
    import transformers
    from parity import hf_reference, logits_parity

    src = tiny_checkpoint(family)
    out = tmp_path / family
    export_model(src, out, target="trt", dtype="fp32", max_seq=128, max_batch=4, progress=False, plugins="always")
    expand_artifact(out)
    assert load_manifest(out).plugins.ops
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rng = np.random.default_rng(SEED)
    lengths = (70, 9, 33) if family == "mistral" else (11, 4, 7)  # mistral's window is 64
    prompts = [rng.integers(3, model.config.vocab_size, n).astype(np.int64) for n in lengths]
    refs = [hf_reference(model, p, 9) for p in prompts]
    assert logits_parity(out, refs[:1], prompts[:1], steps=8) < 1e-4
    assert logits_parity(out, refs, prompts, steps=8) < 1e-4


# ---------------------------------------------------------------- Triton kernels
def _triton_interpreter_runs() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton not installed (pip install triton)"
    return None


@pytest.fixture(scope="module")
def interpreted():
    """All kernel cases, run once in a child process under TRITON_INTERPRET=1 (about 10 s)."""
    reason = _triton_interpreter_runs()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(kernel_cases.__file__)
    proc = subprocess.run([sys.executable, str(script), str(SEED)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kernel_tol(name: str) -> float:
    return 2e-2 if "fp16" in name else 2e-5


@pytest.mark.parametrize("case", [*kernel_cases.ATTENTION, *kernel_cases.RMS])
def test_triton_kernels_interpreted_match_numpy(interpreted, case):
    errs = interpreted[case]
    assert errs and max(errs) <= _kernel_tol(case) * 8, (case, errs, SEED)  # values are N(0,1)-scaled


@pytest.mark.slow
def test_triton_prefill_many_tiles_interpreted():
    reason = _triton_interpreter_runs()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(kernel_cases.__file__)
    proc = subprocess.run([sys.executable, str(script), str(SEED), *kernel_cases.SLOW_ATTENTION], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, errs in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert max(errs) <= _kernel_tol(case) * 8, (case, errs)


@pytest.mark.gpu
@pytest.mark.skipif(not kernel_cases.cuda_available(),
                    reason="needs an NVIDIA GPU with torch CUDA (Triton kernels compiled for it)")
@pytest.mark.parametrize("case", [*kernel_cases.ATTENTION, *kernel_cases.SLOW_ATTENTION, *kernel_cases.RMS])
def test_triton_kernels_on_gpu_match_numpy(case):
    errs = kernel_cases.run_case(case, "cuda", SEED)
    assert max(errs) <= _kernel_tol(case) * 8, (case, errs)
