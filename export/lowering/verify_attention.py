"""The ort target's verify-graph attention: standard ONNX ops over any number of rows.

GroupQueryAttention (the prefill/decode graphs' attention) refuses several tokens over a
non-empty cache unless the batch is one row, so a speculative verify pass of 4 rows would be 4
passes, each reading every weight. This attention takes any rows and stays close to GQA's cost:

    positions [B,S] = past + arange(S),  keys T = max(positions) + 1 (the longest row, not max_seq)
    q, k  = RotaryEmbedding-23(q | k, positions)           (one op each, not a Slice/Mul body)
    cache = ScatterND(past, index [B,Hkv,S,3], k | v)      (in place: past and present are one buffer;
                                                            the index is built once per graph)
    y     = softmax(q K[:T]^T * scale, masked to key <= position (and the window)) V[:T]

Rows are right-padded as in the prefill graph: padded tokens' K/V land past the row's length,
hidden by the mask until a later write replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.export.lowering.lowering import GraphInputs
from decodert.plugins.ops import cached_attention as ca
from decodert.plugins.onnx_builder import GraphBuilder


@dataclass(frozen=True)
class VerifyContext:
    positions: str  # [B,S] int64 ("" with M-RoPE: cos/sin are then per token [B,S,R/2])
    visible: str  # [B,1,S,T] bool
    keys: str  # [1] int64: T
    index: str  # [B,Hkv,S,3] int64: ScatterND's (row, head, position) of every new K/V row
    cos_cache: str
    sin_cache: str


def context(g: GraphBuilder, inp: GraphInputs, kv_heads: int, max_seq: int, window: int,
            tables: tuple[str, str] | None = None) -> VerifyContext:
    """What every layer of one kind shares (built once per graph); ``tables``: M-RoPE's per-token cos and sin
    [B,S,R/2] (plugins/ops/mrope.py), which RotaryEmbedding takes without position ids."""
    with g.scope("verify_attn_context"):
        pos, visible = ca.positions_and_visibility(g, inp.past_lengths, inp.input_ids, max_seq, window)
        keys = g.op("Unsqueeze", g.op("Add", g.op("ReduceMax", pos, keepdims=0), g.const(np.int64(1))), g.const([0]))
        visible = g.op("Slice", visible, g.const([0]), keys, g.const([3]))
        ids_shape = g.op("Shape", inp.input_ids)  # [B, S]
        b, s = (g.op("Slice", ids_shape, g.const([i]), g.const([i + 1])) for i in (0, 1))
        shape = g.op("Concat", b, g.const([kv_heads]), s, axis=0)  # [B, Hkv, S]
        rows = g.op("Unsqueeze", g.op("Range", g.const(np.int64(0)), g.op("Squeeze", b), g.const(np.int64(1))),
                    g.const([1, 2]))
        heads = g.const(np.arange(kv_heads, dtype=np.int64).reshape(1, kv_heads, 1))
        at = g.op("Unsqueeze", pos, g.const([1]))  # [B,1,S]
        index = g.op("Concat", *[g.op("Unsqueeze", g.op("Expand", i, shape), g.const([3])) for i in (rows, heads, at)],
                     axis=3)
    if tables is not None:
        return VerifyContext("", visible, keys, index, *tables)
    return VerifyContext(pos, visible, keys, index, inp.cos_cache, inp.sin_cache)


def attention(g: GraphBuilder, low: Any, ctx: VerifyContext, qkv: str, cache: tuple[str, str, str, str],
              sinks: str | None = None) -> str:
    """qkv [B,S,(H+2Hkv)*D] -> y [B,S,H*D]; writes the new K/V into present (= past) in place."""
    past_key, past_value, present_key, present_value = cache
    s = low.attn
    d, h, hkv = low.head_dim, s.num_heads, s.num_kv_heads
    q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
    rot = low.rotary_dim if low.rotary_dim != d else None  # partial rotary (Phi-3, Qwen3.5)
    q = g.op("RotaryEmbedding", q, ctx.cos_cache, ctx.sin_cache, ctx.positions, num_heads=h, interleaved=0,
             rotary_embedding_dim=rot)
    k = g.op("RotaryEmbedding", k, ctx.cos_cache, ctx.sin_cache, ctx.positions, num_heads=hkv, interleaved=0,
             rotary_embedding_dim=rot)
    for new, past, present in ((k, past_key, present_key), (v, past_value, present_value)):
        rows = g.op("Transpose", g.op("Reshape", new, g.const([0, 0, hkv, d])), perm=[0, 2, 1, 3])  # [B,Hkv,S,D]
        g.op("ScatterND", past, ctx.index, low.kv_store(g, rows, past), outputs=[present])
    first = lambda x, past: low.kv_load(g, g.op("Slice", x, g.const([0]), ctx.keys, g.const([2])), past)  # noqa: E731  keys [0, T)
    q4 = g.op("Reshape", q, g.const([0, 0, h, d]))
    return ca.attend_body(g, q4, first(present_key, past_key), first(present_value, past_value), ctx.visible, num_heads=h, kv_heads=hkv,
                          head_dim=d, max_seq=ctx.keys, scale=low.scale, dtype=low.dtype, softcap=low.softcap,
                          sinks=sinks)
