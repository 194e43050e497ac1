"""The "attention" layer kind's lowering (models/layers/attention.py), one recipe for every target:

    qkv    = h @ qkv^T (+ qkv_bias)                    [T, (H+2Hkv)*D]   (output_gate: q | gate | k | v rows)
    q, k   = rmsnorm per head (qk_norm; v: a weightless rmsnorm with v_norm)
    attn   = CachedAttention(qkv, past/present.i)      [B,S,H*D]  writes K/V in place; the layer's window and
                                                       RoPE table select its context (one per kind of layer)
    o      = (attn * sigmoid(gate)) @ o^T (+ o_bias)
A layer that reads another layer's K/V (``kv_source``, Gemma 4) projects q only and attends over that layer's
cache after it wrote this call's K/V (``Lowering.shared_attention``); it has no cache of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.models.layers import AttentionSpec
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import GraphBuilder


def contexts(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec) -> dict:
    """(window, rope table, reads another layer's cache) -> the lowering's per-graph attention values, one per
    kind of attention layer. Llama: one kind; Gemma: sliding layers (window, local RoPE) and full layers."""
    own: dict = {}
    for i, a in _attention(spec):
        key = (a.window, a.rope_table, False)
        if a.kv_source is None and key not in own:
            table = dataclasses.replace(inp, cos_cache=f"{a.rope_table}.cos", sin_cache=f"{a.rope_table}.sin")
            own[key] = low.for_layer(i).context(g, table, a.window or 0)
    read: dict = {}
    for i, a in _attention(spec):  # the reference attention's context of the layers that read another's cache
        key = (a.window, a.rope_table, True)
        if a.kv_source is not None and key not in read:
            table = dataclasses.replace(inp, cos_cache=f"{a.rope_table}.cos", sin_cache=f"{a.rope_table}.sin")
            with g.scope("read_context"):
                read[key] = low.for_layer(i).read_context(g, table, a.window or 0)
    return {**own, **read}


def context_of(values: dict, spec: ModelSpec, layer: int) -> Any:
    """Layer ``layer``'s value of ``contexts`` (None for a layer of another kind)."""
    a = spec.mixer(layer)
    return values[(a.window, a.rope_table, a.kv_source is not None)] if isinstance(a, AttentionSpec) else None


def _attention(spec: ModelSpec) -> list[tuple[int, AttentionSpec]]:
    return [(i, m) for i, m in ((i, spec.mixer(i)) for i in range(spec.num_layers)) if isinstance(m, AttentionSpec)]


def mixer(g: GraphBuilder, low: Lowering, ctx: Any, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
          linear: Callable[..., str]) -> str:
    """GQA over the layer's K/V cache -> the o projection's output; ``linear(x, target, bias)``: the layer's
    linears (with each row's LoRA update)."""
    a: AttentionSpec = spec.mixer(i)
    if a.kv_source is not None:
        return _shared(g, low, ctx, inp, a, i, h, linear)
    p = f"layers.{i}."
    d = a.head_dim
    width, qd = (a.num_heads + 2 * a.num_kv_heads) * d, a.num_heads * d
    with g.scope("attn"):
        with g.scope("qkv"):
            qkv = linear(h, "qkv", p + "qkv_bias" if a.qkv_bias else None)
        if a.output_gate:  # rows q | gate | k | v
            q, gate, kv = g.op("Split", qkv, g.const([qd, qd, width - qd]), axis=-1, outputs=3)
            qkv = g.op("Concat", q, kv, axis=-1)
        if a.qk_norm:
            with g.scope("qk_norm"):
                qkv = _qk_norm(g, low, a, qkv, p)
        if low.flat_tokens:  # [T, qkv] -> [B, S, qkv]
            qkv = g.op("Reshape", qkv, g.op("Concat", g.op("Shape", inp.input_ids), g.const([width]), axis=0))
        cache = (f"past_key.{i}", f"past_value.{i}", f"present_key.{i}", f"present_value.{i}")
        attn = low.attention(g, ctx, qkv, cache, p + "sinks" if a.sinks else None)  # [B, S, H*D]
        if low.flat_tokens:
            attn = g.op("Reshape", attn, g.const([-1, qd]))
        if a.output_gate:
            attn = g.op("Mul", attn, g.op("Sigmoid", gate))
        with g.scope("o"):
            o = linear(attn, "o", p + "o_bias" if a.o_bias else None)
    return o


def _qk_norm(g: GraphBuilder, low: Lowering, a: AttentionSpec, qkv: str, p: str) -> str:
    """Qwen3: RMSNorm over head_dim on every q and k head (v untouched). qkv [T or B,S, (H+2Hkv)*D]."""
    d, h, hkv = low.head_dim, a.num_heads, a.num_kv_heads
    lead = [0] if low.flat_tokens else [0, 0]  # Reshape's 0 keeps the leading dims
    q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=-1, outputs=3)
    q = g.op("Reshape", low.rms_norm(g, g.op("Reshape", q, g.const(lead + [h, d])), p + "q_norm"), g.const(lead + [h * d]))
    k = g.op("Reshape", low.rms_norm(g, g.op("Reshape", k, g.const(lead + [hkv, d])), p + "k_norm"),
             g.const(lead + [hkv * d]))
    if a.v_norm:  # Gemma 4: RMSNorm without a weight on v
        ones = g.const(np.ones(d, NUMPY_DTYPES[low.dtype]))
        v = g.op("Reshape", low.rms_norm(g, g.op("Reshape", v, g.const(lead + [hkv, d])), ones), g.const(lead + [hkv * d]))
    return g.op("Concat", q, k, v, axis=-1)


def _shared(g: GraphBuilder, low: Lowering, ctx: Any, inp: GraphInputs, a: AttentionSpec, i: int, h: str,
            linear: Callable[..., str]) -> str:
    """Layer i's attention over layer kv_source's cache: q = rope(q_norm(h @ q^T)) -> o's output."""
    p, j = f"layers.{i}.", a.kv_source
    qd, d = a.num_heads * a.head_dim, a.head_dim
    lead = [0] if low.flat_tokens else [0, 0]
    with g.scope("attn"):
        with g.scope("q"):
            q = linear(h, "q")
        if a.qk_norm:
            with g.scope("q_norm"):
                q4 = g.op("Reshape", q, g.const(lead + [a.num_heads, d]))
                q = g.op("Reshape", low.rms_norm(g, q4, p + "q_norm"), g.const(lead + [qd]))
        if low.flat_tokens:  # [T, q] -> [B, S, q]
            q = g.op("Reshape", q, g.op("Concat", g.op("Shape", inp.input_ids), g.const([qd]), axis=0))
        source = (f"past_key.{j}", f"past_value.{j}", f"present_key.{j}", f"present_value.{j}")
        attn = low.shared_attention(g, ctx, q, source)  # [B, S, H*D]
        if low.flat_tokens:
            attn = g.op("Reshape", attn, g.const([-1, qd]))
        with g.scope("o"):
            return linear(attn, "o")
