"""Gemma 4's additions to the decoder layer (E2B/E4B), read from what ModelSpec declares:

    per-layer inputs (spec.per_layer_input_size P, L layers), computed once after the embedding x:
        tok  = embed_per_layer[ids] * sqrt(P)                              [T, L, P]
        ctx  = rmsnorm_P(x @ per_layer_model_proj^T * hidden^-0.5)         [T, L, P]
        ple  = (ctx + tok) * 2^-0.5
    and, at the end of layer i (x: the residual stream after the MLP's add):
        x    = x + rmsnorm(ple_proj(act(ple_gate(x)) * ple[:, i]))
        x    = x * layer_scalar                                            (spec.layer_scalar)
    a layer that shares K/V (spec.kv_source(i) = j != i) projects q only and attends over layer j's cache
    after layer j wrote this call's K/V (``Lowering.shared_attention``); it has no cache of its own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.models.spec import ModelSpec, rope_table_of
from decodert.plugins.onnx_builder import GraphBuilder


def _const(g: GraphBuilder, low: Lowering, value: float) -> str:
    return g.const(np.array(value, NUMPY_DTYPES[low.dtype]))  # rounded to the graph dtype, as transformers does


def per_layer_inputs(g: GraphBuilder, low: Lowering, spec: ModelSpec, ids: str, x: str) -> str:
    """The per-layer inputs [T, L, P] ([B, S, L, P] where the lowering keeps [B, S, hidden])."""
    n, p = spec.num_layers, spec.per_layer_input_size
    shape = g.const([-1, n, p] if low.flat_tokens else [0, 0, n, p])
    with g.scope("per_layer_inputs"):
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
            gate = g.op("Mul", low.activation(g, low.linear(g, x, p + "ple_gate")), mine)
            mlp = low.rms_norm(g, low.linear(g, gate, p + "ple_proj"), p + "ple_norm")
    if spec.layer_scalar:
        with g.scope("layer_scalar"):
            x, mlp = g.op("Mul", x, p + "layer_scalar"), g.op("Mul", mlp, p + "layer_scalar")
    return x, mlp


def read_contexts(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec) -> dict:
    """(window, rope table) -> the reference attention context of the layers that read another layer's cache."""
    contexts: dict = {}
    for i in range(spec.num_layers):
        key = (spec.layer_window(i), rope_table_of(spec, i))
        if spec.kv_source(i) != i and key not in contexts:
            table = dataclasses.replace(inp, cos_cache=f"{key[1]}.cos", sin_cache=f"{key[1]}.sin")
            with g.scope("read_context"):
                contexts[key] = low.for_layer(i).read_context(g, table, key[0] or 0)
    return contexts


def shared_attention(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
                     linear) -> str:
    """Layer i's attention over layer kv_source(i)'s cache: q = rope(q_norm(h @ q^T)) -> o's output."""
    p, j = f"layers.{i}.", spec.kv_source(i)
    qd, d = spec.num_heads * spec.head_dim_of(i), spec.head_dim_of(i)
    lead = [0] if low.flat_tokens else [0, 0]
    with g.scope("attn"):
        with g.scope("q"):
            q = linear(h, "q")
        if spec.qk_norm:
            with g.scope("q_norm"):
                q4 = g.op("Reshape", q, g.const(lead + [spec.num_heads, d]))
                q = g.op("Reshape", low.rms_norm(g, q4, p + "q_norm"), g.const(lead + [qd]))
        if low.flat_tokens:  # [T, q] -> [B, S, q]
            q = g.op("Reshape", q, g.op("Concat", g.op("Shape", inp.input_ids), g.const([qd]), axis=0))
        source = (f"past_key.{j}", f"past_value.{j}", f"present_key.{j}", f"present_value.{j}")
        attn = low.shared_attention(g, ctx, q, source)  # [B, S, H*D]
        if low.flat_tokens:
            attn = g.op("Reshape", attn, g.const([-1, qd]))
        with g.scope("o"):
            return linear(attn, "o")
