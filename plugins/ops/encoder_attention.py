"""Bidirectional multi-head attention of a vision encoder, defined once (export/lowering: the portable and trt
vision graphs use this body; the ort target's lowering emits ``com.microsoft.MultiHeadAttention`` instead).

    q, k, v  [B, S, H*D]           B: tiles, windows or 1; every query sees every key of its row
    valid    [B, S] bool, optional  keys that exist (a window padded to S rows); None: all
    bias     [S, S], optional       added to every head's scores (a mask of 0 and a large negative)
    y = softmax(q k^T * scale + mask) v  per head, as [B, S, H*D]
"""

from __future__ import annotations

import numpy as np

from decodert.plugins.onnx_builder import GraphBuilder


def encoder_attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, scale: float,
                          valid: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
    b, s, c = q.shape
    split = lambda x: x.reshape(b, s, heads, c // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) * scale
    if valid is not None:
        scores = np.where(valid[:, None, None, :], scores, -np.inf)
    if bias is not None:
        scores = scores + bias
    p = np.exp(scores - scores.max(-1, keepdims=True))
    y = (p / p.sum(-1, keepdims=True)) @ split(v)
    return y.transpose(0, 2, 1, 3).reshape(b, s, c)


def encoder_attention_body(g: GraphBuilder, q: str, k: str, v: str, heads: int, head_dim: int, scale: float,
                           np_dtype: type, valid: str | None = None, bias: str | None = None) -> str:
    """Standard ONNX ops: MatMul, Softmax, MatMul over the [B, H, S, S] scores."""
    def split(x: str, perm: list[int]) -> str:
        return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, heads, head_dim])), perm=perm)

    scores = g.op("Mul", g.op("MatMul", split(q, [0, 2, 1, 3]), split(k, [0, 2, 3, 1])),
                  g.const(np.array(scale, np_dtype)))  # [B, H, S, S]
    if valid is not None:
        low = -1e4 if np_dtype == np.float16 else -1e9
        mask = g.op("Where", g.op("Unsqueeze", valid, g.const([1, 2])), g.const(np.array(0, np_dtype)),
                    g.const(np.array(low, np_dtype)))  # [B, 1, 1, S]
        scores = g.op("Add", scores, mask)
    if bias is not None:
        scores = g.op("Add", scores, bias)
    ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), split(v, [0, 2, 1, 3]))  # [B, H, S, D]
    return g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.const([0, 0, heads * head_dim]))
