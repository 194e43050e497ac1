"""The ort target's prefill attention for a model whose image tokens attend to each other both ways
(Gemma 3, ``ModelSpec.bidirectional_images``): GroupQueryAttention is causal only.

    y = GroupQueryAttention(qkv, past, ...)         writes K/V in place as always (the cache contract)
    y = If(max(ahead) > 0,                          a prompt with images in this call:
           then: softmax(q K[:T]^T, key j visible iff j <= pos_i + ahead_i (and the window)) V[:T]
                 over the cache GQA has just written (q roped with RotaryEmbedding, keys T = max(pos) + 1),
           else: y)                                 a text prompt (and every decode step) pays one ReduceMax

GQA's own output is dropped in the image case: the same cache, another mask. The portable and trt
targets build their mask from ``ahead`` directly (plugins/ops/cached_attention.py positions_and_visibility).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import helper

from decodert.plugins.ops import cached_attention as ca
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder


def any_ahead(g: GraphBuilder, ahead: str) -> str:
    """[] bool: whether some query of this call sees later keys (an image in the call)."""
    return g.op("Greater", g.op("ReduceMax", ahead, keepdims=0), g.const(np.int64(0)))


def positions(g: GraphBuilder, past_lengths: str, input_ids: str) -> str:
    """[B,S] int64: past + arange(S)."""
    seq = g.op("Gather", g.op("Shape", input_ids), g.const(np.int64(1)), axis=0)
    steps = g.op("Range", g.const(np.int64(0)), seq, g.const(np.int64(1)))
    return g.op("Add", g.op("Unsqueeze", past_lengths, g.const([1])), g.op("Unsqueeze", steps, g.const([0])))


def widen(g: GraphBuilder, low: Any, ctx: Any, q: str, rotated: bool, gqa_out: str,
          cache: tuple[str, str, str, str], sinks: str | None) -> str:
    """``gqa_out`` [B,S,H*D], or, when the call holds image tokens, the attention under the widened mask.
    ``q`` [B,S,H*D]: rotated already when ``rotated`` (partial rotary), else roped here. ``ctx``: the
    GqaContext (positions, ahead, any_ahead, window, cos/sin caches)."""
    s = low.attn
    d, h, hkv = low.head_dim, s.num_heads, s.num_kv_heads
    past_key, past_value, present_key, present_value = cache
    body = g.nested("image_attention")
    if not rotated:
        q = body.op("RotaryEmbedding", q, ctx.cos_cache, ctx.sin_cache, ctx.positions, num_heads=h, interleaved=0)
    keys = body.op("Unsqueeze", body.op("Add", body.op("ReduceMax", ctx.positions, keepdims=0),
                                        body.const(np.int64(1))), body.const([0]))  # [1]: T
    _, visible = ca.positions_and_visibility(body, ctx.past_lengths, ctx.input_ids, low.max_seq, ctx.window, ctx.ahead)
    visible = body.op("Slice", visible, body.const([0]), keys, body.const([3]))
    first = lambda x, past: low.kv_load(body, body.op("Slice", x, body.const([0]), keys, body.const([2])), past)  # noqa: E731
    y = ca.attend_body(body, body.op("Reshape", q, body.const([0, 0, h, d])), first(present_key, past_key),
                       first(present_value, past_value), visible, num_heads=h, kv_heads=hkv, head_dim=d,
                       max_seq=keys, scale=low.scale, dtype=low.dtype, softcap=low.softcap, sinks=sinks)
    then = _subgraph(g, body, y, "image_attention_then", low.dtype)
    other = g.nested("image_attention_else")
    z = other.op("Identity", gqa_out)
    return g.op("If", ctx.any_ahead, then_branch=then, else_branch=_subgraph(g, other, z, "image_attention_else",
                                                                               low.dtype))


def _subgraph(g: GraphBuilder, body: GraphBuilder, out: str, name: str, dtype: str) -> Any:
    """A branch graph of ``body``'s nodes; its constants renamed so they never reuse the outer graph's names."""
    unique = f"{name}_{len(g.nodes)}/"
    rename = {n: unique + n for n in body.initializers}
    for node in body.nodes:
        node.input[:] = [rename.get(n, n) for n in node.input]
    consts = [helper.make_node("Constant", [], [rename[n]], value=t) for n, t in body.initializers.items()]
    return helper.make_graph(consts + body.nodes, name, [], [helper.make_tensor_value_info(out, DTYPES[dtype], None)])
