"""The pre-norm transformer encoder layer of the Whisper-style audio encoders, built once for every graph that has
one: Whisper's encoder.onnx (export/seq2seq_export.py) and audio.onnx of the ``qwen3_asr`` and ``whisper`` encoder
kinds (export/lowering/audio/graph.py, export/lowering/audio/whisper.py).

    per layer (p = the layer's weight prefix):
      x = x + linear(attend(qkv(LayerNorm(x; p.ln1))), p.o)          bidirectional self-attention
      x = x + linear(gelu(linear(LayerNorm(x; p.ln2), p.fc1)), p.fc2)

The graphs differ only in how a linear reads its weight (``linear``: Whisper's [in, out] MatMul + Add, audio.onnx's
[out, in] Gemm), how q, k, v are made (``qkv``: fused or three projections) and the attention (``attend``: the
target lowering's, with or without a key mask); each passes its own as functions. The ops and their order are
the same as each graph had on its own.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from decodert.plugins.onnx_builder import GraphBuilder

Linear = Callable[[str, str, "str | None"], str]  # (x, weight, bias or None) -> y


def gelu(g: GraphBuilder, x: str, np_dtype: type = np.float32) -> str:
    """0.5 x (1 + erf(x / sqrt 2)): torch's exact GELU (ACT2FN["gelu"], F.gelu)."""
    k = lambda value: g.const(np.array(value, np_dtype))  # noqa: E731
    return g.op("Mul", g.op("Mul", x, k(0.5)), g.op("Add", g.op("Erf", g.op("Mul", x, k(1 / math.sqrt(2)))), k(1.0)))


def layer_norm(g: GraphBuilder, x: str, name: str, eps: float) -> str:
    """LayerNorm over the last axis with weight ``name`` and bias ``name_bias``."""
    return g.op("LayerNormalization", x, name, name + "_bias", axis=-1, epsilon=eps)


def gemm(g: GraphBuilder) -> Linear:
    """A linear over [R, in] rows with a weight stored [out, in] (audio.onnx): one Gemm."""
    return lambda x, w, b=None: g.op("Gemm", x, w, b, transB=1) if b else g.op("Gemm", x, w, transB=1)


def matmul(g: GraphBuilder) -> Linear:
    """A linear over [.., in] with a weight stored [in, out] (Whisper's encoder.onnx): MatMul, then Add."""
    def linear(x: str, w: str, b: str | None = None) -> str:
        y = g.op("MatMul", x, w)
        return g.op("Add", y, b) if b else y
    return linear


def separate_qkv(linear: Linear, p: str) -> Callable[[str], tuple[str, str, str]]:
    """Whisper's q, k, v: three projections, q and v with a bias, k without."""
    return lambda h: (linear(h, p + "q", p + "q_bias"), linear(h, p + "k"), linear(h, p + "v", p + "v_bias"))


def mlp(g: GraphBuilder, x: str, p: str, eps: float, linear: Linear, np_dtype: type = np.float32) -> str:
    """x + fc2(gelu(fc1(LayerNorm(x))))."""
    with g.scope("mlp"):
        h = gelu(g, linear(layer_norm(g, x, p + "ln2", eps), p + "fc1", p + "fc1_bias"), np_dtype)
        return g.op("Add", x, linear(h, p + "fc2", p + "fc2_bias"))


def encoder_layer(g: GraphBuilder, x: str, p: str, eps: float, linear: Linear,
                  qkv: Callable[[str], tuple[str, str, str]], attend: Callable[[str, str, str], str],
                  np_dtype: type = np.float32) -> str:
    """One pre-norm layer: ``qkv(h)`` -> (q, k, v), ``attend(q, k, v)`` -> the context as ``linear`` reads it."""
    with g.scope("attn"):
        q, k, v = qkv(layer_norm(g, x, p + "ln1", eps))
        x = g.op("Add", x, linear(attend(q, k, v), p + "o", p + "o_bias"))
    return mlp(g, x, p, eps, linear, np_dtype)
