"""Gemma 4's additions to the decoder layer (E2B/E4B), read from what ModelSpec declares:

    per-layer inputs (spec.per_layer_inputs: P = its size, L layers), computed once after the embedding x:
        tok  = embed_per_layer[ids] * sqrt(P)                              [T, L, P]
        ctx  = rmsnorm_P(x @ per_layer_model_proj^T * hidden^-0.5)         [T, L, P]
        ple  = (ctx + tok) * 2^-0.5
    (with media rows placed, ids[image_positions] read as spec.images.per_layer_token first: Gemma 4's audio rows)
    and, at the end of layer i (x: the residual stream after the MLP's add):
        x    = x + rmsnorm(ple_proj(act(ple_gate(x)) * ple[:, i]))
        x    = x * layer_scalar                                            (spec.layer_scalar)
(the layers that share K/V are attention layers with a ``kv_source``: export/lowering/layers/attention.py)
"""

from __future__ import annotations

import numpy as np

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.lowering import Lowering
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import GraphBuilder


def _const(g: GraphBuilder, low: Lowering, value: float) -> str:
    return g.const(np.array(value, NUMPY_DTYPES[low.dtype]))  # rounded to the graph dtype, as transformers does


def per_layer_inputs(g: GraphBuilder, low: Lowering, spec: ModelSpec, ids: str, x: str, placed: bool = False) -> str:
    """The per-layer inputs [T, L, P] ([B, S, L, P] where the lowering keeps [B, S, hidden]); ``placed``: the graph
    places rows at image_positions, whose token part reads ``spec.images.per_layer_token`` when the spec names one."""
    n, p = spec.num_layers, spec.per_layer_inputs.size
    shape = g.const([-1, n, p] if low.flat_tokens else [0, 0, n, p])
    with g.scope("per_layer_inputs"):
        if placed and spec.images is not None and spec.images.per_layer_token is not None:
            flat = g.op("Reshape", ids, g.const([-1]))  # ids[image_positions] = per_layer_token
            pad = g.op("Expand", g.const(np.array([spec.images.per_layer_token], np.int64)), g.op("Shape", "image_positions"))
            flat = g.op("ScatterND", flat, g.op("Unsqueeze", "image_positions", g.const([1])), pad)
            ids = g.op("Reshape", flat, g.op("Shape", ids))
        tok = g.op("Mul", g.op("Gather", "embed_per_layer", ids, axis=0), _const(g, low, p ** 0.5))
        tok = g.op("Reshape", tok, shape)
        proj = g.op("Mul", low.linear(g, x, "per_layer_model_proj"), _const(g, low, spec.hidden_size ** -0.5))
        proj = low.rms_norm(g, g.op("Reshape", proj, shape), "per_layer_proj_norm")
        return g.op("Mul", g.op("Add", proj, tok), _const(g, low, 2 ** -0.5))


def layer_end(g: GraphBuilder, low: Lowering, spec: ModelSpec, i: int, x: str, mlp: str,
              ple: str | None) -> tuple[str, str]:
    """The residual stream ``x`` + ``mlp`` after layer i's per-layer input and scalar, returned as the pair
    (stream, addend) whose sum it is (the next layer fuses that add with its norm)."""
    if ple is None and not spec.layer_scalar:
        return x, mlp
    p = f"layers.{i}."
    if ple is not None:
        with g.scope("per_layer_input"):
            x = g.op("Add", x, mlp)
            mine = g.op("Gather", ple, g.const(np.array(i, np.int64)), axis=-2)  # [.., P]
            act = spec.per_layer_inputs.activation
            gate = g.op("Mul", low.activation(g, low.linear(g, x, p + "ple_gate"), act), mine)
            mlp = low.rms_norm(g, low.linear(g, gate, p + "ple_proj"), p + "ple_norm")
    if spec.layer_scalar:
        with g.scope("layer_scalar"):
            x, mlp = g.op("Mul", x, p + "layer_scalar"), g.op("Mul", mlp, p + "layer_scalar")
    return x, mlp
