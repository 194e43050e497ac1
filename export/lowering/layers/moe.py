"""The "moe" MLP kind's lowering (models/layers/moe.py): the router's top-k experts (``Lowering.moe``: each
target's kernel, plugins/ops/moe.py's bodies), plus the dense MLP beside them where the spec has one
(Granite 4.0-H), gated per token where ``shared_gate`` (Qwen3.5-MoE: x sigmoid(h @ shared_gate^T))."""

from __future__ import annotations

from typing import Callable

from decodert.export.lowering.layers import mlp as dense_mlp
from decodert.export.lowering.lowering import Lowering
from decodert.models.layers import MoESpec
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import GraphBuilder


def mlp(g: GraphBuilder, low: Lowering, spec: ModelSpec, i: int, h: str, linear: Callable[..., str],
        one_token_rows: bool) -> str:
    """The experts of layer ``i`` on h (``one_token_rows``: the decode graph, which gathers the chosen experts)."""
    m: MoESpec = spec.mlp(i)
    with g.scope("moe"):
        down = low.moe(g, h, f"layers.{i}.", m, one_token_rows)
        if m.shared is not None:
            with g.scope("shared"):
                shared = dense_mlp.dense(g, low, m.shared, h, linear)
                if m.shared_gate:  # [.., 1] per token
                    shared = g.op("Mul", shared, g.op("Sigmoid", linear(h, "shared_gate")))
                down = g.op("Add", down, shared)
    return down
