"""The "dense" MLP kind's lowering (models/layers/mlp.py), one recipe for every target:

    m = down(act(gate) * up)      gate_up = h @ gate_up^T [T, 2I] (one fused GEMM); act = the spec's activation
        down(act(up))             where the spec is not gated (Nemotron-H's ReLU²)
"""

from __future__ import annotations

from typing import Callable

from decodert.export.lowering.lowering import Lowering
from decodert.models.layers import DenseMLPSpec
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import GraphBuilder


def mlp(g: GraphBuilder, low: Lowering, spec: ModelSpec, i: int, h: str, linear: Callable[..., str],
        one_token_rows: bool) -> str:
    with g.scope("mlp"):
        return dense(g, low, spec.mlp(i), h, linear)


def dense(g: GraphBuilder, low: Lowering, m: DenseMLPSpec, h: str, linear: Callable[..., str]) -> str:
    """down(act(gate) * up) of ``m`` on h; ``linear(x, target)``: the layer's linears."""
    if not m.gated:
        with g.scope("up"):
            act = low.activation(g, linear(h, "up"), m.activation)
        with g.scope("down"):
            return linear(act, "down")
    with g.scope("gate_up"):
        gate, up = g.op("Split", linear(h, "gate_up"), g.const([m.size] * 2), axis=-1, outputs=2)
    act = g.op("Mul", low.activation(g, gate, m.activation), up)  # act(gate) * up
    with g.scope("down"):
        return linear(act, "down")
