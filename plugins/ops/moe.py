"""Mixture-of-experts MLP (router + SwiGLU experts), defined once: numpy reference and reference ONNX bodies.

    logits  = x @ router^T                       [T, E]
    probs   = softmax(logits)                    [T, E]   (float32)
    w, idx  = top_k(probs)                       [T, k]   w rescaled to sum 1 when ``renormalize``
    h_e     = x @ gate_up_e^T                    [T, 2 Ie]  rows interleaved: gate 0, up 0, gate 1, ...
    y       = sum_k w_k * (silu(gate) * up) @ down_e^T
  gpt-oss adds a router bias, biases on every expert's gate_up and down, and a clamped SwiGLU:
    gate    = min(gate, limit);  up = clip(up, -limit, limit)
    act     = gate * sigmoid(alpha * gate) * (up + beta)      (SwiGlu below; alpha 1, beta 0: silu(gate) * up)

Two standard-op bodies compute it; a lowering picks by how many tokens a call carries:

- ``gathered``: gather the k chosen experts' matrices per token ([T, k, rows, in]) and multiply.
  Reads only the chosen experts: the decode graph's choice (T = batch rows, one token each), where
  decoding is bound by the weight bytes read.
- ``masked``: every expert on every token, each expert's output weighted by a [T, E] matrix that
  is zero outside the top-k. Reads every expert once per call and copies no weights per token:
  the prefill / verify choice, where T is a prompt and a gather would copy T*k expert matrices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decodert.plugins.onnx_builder import GraphBuilder


@dataclass(frozen=True)
class SwiGlu:
    """The experts' activation: gate * sigmoid(alpha * gate) * (up + beta), gate and up clamped by limit."""

    limit: float | None = None
    alpha: float = 1.0
    beta: float = 0.0

    @property
    def plain(self) -> bool:
        """silu(gate) * up: the family's own activation serves it (Lowering.activation)."""
        return self.limit is None and self.alpha == 1.0 and self.beta == 0.0

    def ref(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.limit is not None:
            gate, up = np.minimum(gate, self.limit), np.clip(up, -self.limit, self.limit)
        return gate / (1 + np.exp(-self.alpha * gate)) * (up + self.beta)


def moe_ref(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, *, k: int,
            renormalize: bool, router_bias: np.ndarray | None = None, gate_up_bias: np.ndarray | None = None,
            down_bias: np.ndarray | None = None, swiglu: SwiGlu = SwiGlu()) -> np.ndarray:
    """x [T, h], router [E, h], gate_up [E, 2 Ie, h] (interleaved), down [E, h, Ie] -> [T, h] float32."""
    logits = x.astype(np.float32) @ router.T.astype(np.float32)
    logits = logits if router_bias is None else logits + router_bias
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        idx = np.argsort(-probs[t], kind="stable")[:k]
        w = probs[t, idx] / (probs[t, idx].sum() if renormalize else 1.0)
        for e, wt in zip(idx, w):
            h = gate_up[e] @ x[t] + (0 if gate_up_bias is None else gate_up_bias[e])
            y = down[e] @ swiglu.ref(h[0::2], h[1::2]) + (0 if down_bias is None else down_bias[e])
            out[t] += wt * y
    return out


def route(g: GraphBuilder, logits: str, k: int, renormalize: bool, dtype_to: int | None) -> tuple[str, str]:
    """Router logits [T, E] -> (weights [T, k] in the graph dtype, expert indices [T, k] int64)."""
    probs = g.op("Softmax", logits if dtype_to is None else g.op("Cast", logits, to=1), axis=-1)
    weights, idx = g.op("TopK", probs, g.const([k]), axis=-1, outputs=2)
    if renormalize:
        weights = g.op("Div", weights, g.op("ReduceSum", weights, g.const([-1]), keepdims=1))
    return (weights if dtype_to is None else g.op("Cast", weights, to=dtype_to)), idx


def _swiglu(g: GraphBuilder, h: str, ie: int, act: Callable[[GraphBuilder, str], str], glu: SwiGlu) -> str:
    """h [a, b, 2 Ie] interleaved (gate, up) pairs -> act(gate) * up [a, b, Ie] (or glu's clamped form)."""
    gate, up = g.op("Split", g.op("Reshape", h, g.const([0, 0, ie, 2])), g.const([1, 1]), axis=-1, outputs=2)
    gate, up = g.op("Squeeze", gate, g.const([-1])), g.op("Squeeze", up, g.const([-1]))
    if glu.plain:
        return g.op("Mul", act(g, gate), up)
    like = lambda v: g.op("CastLike", g.const(np.float32(v)), h)  # noqa: E731
    if glu.limit is not None:
        gate = g.op("Min", gate, like(glu.limit))
        up = g.op("Max", g.op("Min", up, like(glu.limit)), like(-glu.limit))
    act_gate = g.op("Mul", gate, g.op("Sigmoid", g.op("Mul", gate, like(glu.alpha))))
    return g.op("Mul", act_gate, g.op("Add", up, like(glu.beta)))


def _bias(g: GraphBuilder, y: str, bias: str | None) -> str:
    return y if bias is None else g.op("Add", y, bias)


def _matmul_t(g: GraphBuilder, x: str, w: str, rank: int) -> str:
    """x @ w^T over the last two axes of w (rank ``rank``). MatMul after a Transpose, not Einsum:
    TensorRT-RTX 1.7 fails to build an Einsum that reads a block-dequantized weight."""
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return g.op("MatMul", x, g.op("Transpose", w, perm=perm))


def gathered_body(g: GraphBuilder, x: str, weights: str, idx: str, ie: int, gate_up: Callable[[str], str],
                  down: Callable[[str], str], act: Callable[[GraphBuilder, str], str], glu: SwiGlu = SwiGlu(),
                  biases: tuple[str, str] | None = None) -> str:
    """x [T, h]; ``gate_up(idx)`` / ``down(idx)`` give the chosen experts' float matrices
    [T, k, 2 Ie, h] / [T, k, h, Ie] -> y [T, h]; ``biases``: the experts' (gate_up [E, 2 Ie], down [E, h])."""
    b1, b2 = (None, None) if biases is None else (g.op("Gather", b, idx, axis=0) for b in biases)
    rows = g.op("Unsqueeze", x, g.const([1, 2]))  # [T, 1, 1, h]
    h = _bias(g, g.op("Squeeze", _matmul_t(g, rows, gate_up(idx), 4), g.const([2])), b1)  # [T, k, 2 Ie]
    a = g.op("Unsqueeze", _swiglu(g, h, ie, act, glu), g.const([2]))  # [T, k, 1, Ie]
    y = _bias(g, g.op("Squeeze", _matmul_t(g, a, down(idx), 4), g.const([2])), b2)  # [T, k, h]
    return g.op("Einsum", y, weights, equation="tkh,tk->th")


def masked_body(g: GraphBuilder, x: str, weights: str, idx: str, num_experts: int, ie: int, gate_up: str,
                down: str, act: Callable[[GraphBuilder, str], str], glu: SwiGlu = SwiGlu(),
                biases: tuple[str, str] | None = None) -> str:
    """x [T, h]; every expert ([E, 2 Ie, h], [E, h, Ie] float) on every token, weighted by the
    top-k weights scattered into [T, E] (zero elsewhere) -> y [T, h]."""
    tokens = g.op("Gather", g.op("Shape", x), g.const([0]), axis=0)
    dense = g.op("Expand", g.op("CastLike", g.const(np.float32(0)), weights),
                 g.op("Concat", tokens, g.const([num_experts]), axis=0))  # [T, E]
    dense = g.op("ScatterElements", dense, idx, weights, axis=1)
    b1, b2 = (None, None) if biases is None else (g.op("Unsqueeze", b, g.const([1])) for b in biases)  # [E, 1, n]
    h = _bias(g, _matmul_t(g, x, gate_up, 3), b1)  # [E, T, 2 Ie]
    y = _bias(g, _matmul_t(g, _swiglu(g, h, ie, act, glu), down, 3), b2)  # [E, T, h]
    return g.op("Einsum", y, dense, equation="eth,te->th")
