"""The vision encoders' attention (plugins/ops/encoder_attention.py): the standard-op body (portable, trt) and the
ort target's com.microsoft.MultiHeadAttention against numpy, with every key, with padded keys (Qwen's window
slots) and with an additive mask (the trt graph's windows)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from decodert.export.lowering.lower_ort import OrtLowering
from decodert.export.lowering.lowering import Lowering
from decodert.plugins.onnx_builder import GraphBuilder
from decodert.plugins.ops.encoder_attention import encoder_attention_ref

HEADS, D = 3, 16


def _run(low: type[Lowering], q, k, v, valid=None, bias=None, np_dtype=np.float32) -> tuple[np.ndarray, set[str]]:
    g = GraphBuilder("t", {"": 17})
    names = [g.input(n, "fp32" if np_dtype == np.float32 else "fp16", ["b", "s", HEADS * D]) for n in "qkv"]
    feeds = dict(zip("qkv", (t.astype(np_dtype) for t in (q, k, v))))
    if valid is not None:
        g.input("valid", "bool", ["b", "s"])
        feeds["valid"] = valid
    if bias is not None:
        g.input("bias", "fp32", ["s", "s"])
        feeds["bias"] = bias.astype(np.float32)
    y = low.encoder_attention(g, *names, HEADS, D, np_dtype, "valid" if valid is not None else None,
                              "bias" if bias is not None else None)
    g.output(y, "y", "fp32" if np_dtype == np.float32 else "fp16", ["b", "s", HEADS * D])
    model = g.to_model(ir_version=10)
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0].astype(np.float32), {n.op_type for n in model.graph.node}


@pytest.mark.parametrize("low", [Lowering, OrtLowering])
def test_encoder_attention_equals_numpy(low, rng):
    b, s = int(rng.integers(1, 4)), int(rng.integers(5, 40))
    q, k, v = (rng.standard_normal((b, s, HEADS * D)).astype(np.float32) for _ in range(3))
    scale = D ** -0.5
    y, ops = _run(low, q, k, v)
    np.testing.assert_allclose(y, encoder_attention_ref(q, k, v, HEADS, scale), atol=2e-5)
    assert ("MultiHeadAttention" in ops) == (low is OrtLowering)
    valid = np.arange(s)[None, :] < rng.integers(1, s + 1, (b, 1))  # padded window slots: the first n keys exist
    y, _ = _run(low, q, k, v, valid=valid)
    np.testing.assert_allclose(y, encoder_attention_ref(q, k, v, HEADS, scale, valid=valid), atol=2e-5)
    group = rng.integers(0, 3, s)  # a window mask over all keys (the trt graph's), standard ops on every target
    bias = np.where(group[:, None] == group[None, :], 0, -1e9).astype(np.float32)
    y, ops = _run(low, q, k, v, bias=bias)
    np.testing.assert_allclose(y, encoder_attention_ref(q, k, v, HEADS, scale, bias=bias), atol=2e-5)
    assert "MultiHeadAttention" not in ops


def test_fp16_keeps_the_standard_ops_on_ort(rng):
    """MultiHeadAttention's CPU kernel is float32 only: an fp16 vision graph attends in standard ops."""
    q, k, v = (rng.standard_normal((2, 9, HEADS * D)).astype(np.float32) for _ in range(3))
    y, ops = _run(OrtLowering, q, k, v, np_dtype=np.float16)
    assert "MultiHeadAttention" not in ops
    ref = encoder_attention_ref(*(t.astype(np.float16).astype(np.float32) for t in (q, k, v)), HEADS, D ** -0.5)
    np.testing.assert_allclose(y, ref, atol=5e-3)
