"""CachedAttention: RoPE + write new K/V into the cache at past_lengths + causal GQA attention.

    q [B,S,H*D]   k,v [B,S,Hkv*D]   past_key/past_value [B,Hkv,Smax,D]   past_lengths [B] int64
        |              |
      rope(pos)      rope(pos) (k only)          pos[b,s] = past_lengths[b] + s
        |              |
        |        write rows pos[b,:] of cache  -> present_key/present_value (same buffers)
        |              |
        +---- softmax(q K^T * scale, key j visible iff j <= pos (and j > pos - window)) V
                       |
                 y [B,S,H*D]

Rows are right-padded: padded queries compute garbage nobody reads, and their K/V land past
the row's valid length where the mask hides them until a later write replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.registry import OpDef, register


# ---- numpy reference ---------------------------------------------------------------------
def rope_ref(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [B,S,n,D], pos [B,S]; cos/sin [max_pos, R/2]; rotate-half on the first R dims."""
    half = cos.shape[1]
    c, s = cos[pos][:, :, None, :], sin[pos][:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1).astype(x.dtype)


def cached_attention_ref(q, k, v, past_key, past_value, past_lengths, cos_cache, sin_cache, *,
                         num_heads, kv_num_heads, scale=0.0, sliding_window=0, **_):
    """Returns (y [B,S,H*D], present_key, present_value); inputs are not modified."""
    b_, s_ = q.shape[:2]
    d = past_key.shape[-1]
    smax = past_key.shape[2]
    scale = scale or 1.0 / np.sqrt(d)
    pos = past_lengths[:, None].astype(np.int64) + np.arange(s_)[None]  # [B,S]
    qr = rope_ref(q.reshape(b_, s_, num_heads, d), pos, cos_cache, sin_cache)
    kr = rope_ref(k.reshape(b_, s_, kv_num_heads, d), pos, cos_cache, sin_cache)
    vr = v.reshape(b_, s_, kv_num_heads, d)
    pk, pv = past_key.copy(), past_value.copy()
    for b in range(b_):
        p0 = int(past_lengths[b])
        pk[b, :, p0 : p0 + s_] = kr[b].transpose(1, 0, 2)
        pv[b, :, p0 : p0 + s_] = vr[b].transpose(1, 0, 2)
    keys = np.arange(smax)[None, None, :]  # [1,1,Smax]
    visible = keys <= pos[:, :, None]  # [B,S,Smax]
    if sliding_window:
        visible &= keys > pos[:, :, None] - sliding_window
    group = num_heads // kv_num_heads
    kk = np.repeat(pk.astype(np.float32), group, axis=1)  # [B,H,Smax,D]
    vv = np.repeat(pv.astype(np.float32), group, axis=1)
    scores = np.einsum("bshd,bhtd->bhst", qr.astype(np.float32), kk) * scale
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.einsum("bhst,bhtd->bshd", probs, vv).reshape(b_, s_, num_heads * d)
    return y.astype(q.dtype), pk, pv


# ---- reference body (standard ONNX ops, opset >= 18) -------------------------------------
@dataclass(frozen=True)
class AttnContext:
    """Per-graph values every layer's attention shares (built once, not per layer)."""

    positions: str  # [B,S] int64
    visible: str  # [B,1,S,Smax] bool
    cos: str  # [B,S,1,R/2] T, gathered at positions
    sin: str


def positions_and_visibility(g: GraphBuilder, past_lengths: str, input_ids: str, max_seq: int,
                             sliding_window: int = 0, ahead: str | None = None) -> tuple[str, str]:
    """positions [B,S] int64 = past + arange(S); visible [B,1,S,Smax] bool (key j <= position, or
    j <= position + ahead with ``ahead`` [B,S]: the later tokens of a query's own image, Gemma 3;
    a sliding window still bounds keys from below: j > position - window)."""
    seq = g.op("Gather", g.op("Shape", input_ids), g.const(np.int64(1)), axis=0)
    steps = g.op("Range", g.const(np.int64(0)), seq, g.const(np.int64(1)))  # [S]
    pos = g.op("Add", g.op("Unsqueeze", past_lengths, g.const([1])), g.op("Unsqueeze", steps, g.const([0])))
    pos4 = g.op("Unsqueeze", pos, g.const([1, 3]))  # [B,1,S,1]
    keys = g.const(np.arange(max_seq, dtype=np.int64).reshape(1, 1, 1, max_seq))
    last = pos4 if ahead is None else g.op("Add", pos4, g.op("Unsqueeze", ahead, g.const([1, 3])))
    visible = g.op("LessOrEqual", keys, last)
    if sliding_window:
        lower = g.op("Sub", pos4, g.const(np.int64(sliding_window)))
        visible = g.op("And", visible, g.op("Greater", keys, lower))
    return pos, visible


def make_context(g: GraphBuilder, past_lengths: str, input_ids: str, cos_cache: str, sin_cache: str,
                 max_seq: int, sliding_window: int = 0, ahead: str | None = None) -> AttnContext:
    with g.scope("attn_context"):
        pos, visible = positions_and_visibility(g, past_lengths, input_ids, max_seq, sliding_window, ahead)
        cos = g.op("Unsqueeze", g.op("Gather", cos_cache, pos, axis=0), g.const([2]))
        sin = g.op("Unsqueeze", g.op("Gather", sin_cache, pos, axis=0), g.const([2]))
    return AttnContext(pos, visible, cos, sin)


def rope_body(g: GraphBuilder, x4: str, ctx: AttnContext, head_dim: int, rotary_dim: int) -> str:
    """x4 [B,S,n,D] -> rotate-half RoPE on the first rotary_dim dims."""
    half = rotary_dim // 2
    x1 = g.op("Slice", x4, g.const([0]), g.const([half]), g.const([3]))
    x2 = g.op("Slice", x4, g.const([half]), g.const([rotary_dim]), g.const([3]))
    a = g.op("Sub", g.op("Mul", x1, ctx.cos), g.op("Mul", x2, ctx.sin))
    b = g.op("Add", g.op("Mul", x2, ctx.cos), g.op("Mul", x1, ctx.sin))
    parts = [a, b]
    if rotary_dim < head_dim:
        parts.append(g.op("Slice", x4, g.const([rotary_dim]), g.const([head_dim]), g.const([3])))
    return g.op("Concat", *parts, axis=3)


def write_cache_body(g: GraphBuilder, past: str, new_bhsd: str, ctx: AttnContext, kv_heads: int, out: str) -> str:
    """ScatterND rows pos[b,s] of past [B,Hkv,Smax,D] with new [B,Hkv,S,D]."""
    shape = g.op("Shape", new_bhsd, end=3)  # [B,Hkv,S]
    b_idx = g.op("Expand", g.op("Unsqueeze", g.op("Range", g.const(np.int64(0)),
                 g.op("Gather", shape, g.const(np.int64(0)), axis=0), g.const(np.int64(1))), g.const([1, 2])), shape)
    h_idx = g.op("Expand", g.const(np.arange(kv_heads, dtype=np.int64).reshape(1, kv_heads, 1)), shape)
    p_idx = g.op("Expand", g.op("Unsqueeze", ctx.positions, g.const([1])), shape)
    idx = g.op("Concat", *[g.op("Unsqueeze", i, g.const([3])) for i in (b_idx, h_idx, p_idx)], axis=3)
    return g.op("ScatterND", past, idx, new_bhsd, outputs=[out])[0]


def attend_body(g: GraphBuilder, q4: str, key: str, value: str, visible: str, *, num_heads: int,
                kv_heads: int, head_dim: int, max_seq: int | str, scale: float, dtype: str, out: str | None = None,
                softcap: float = 0.0, sinks: str | None = None) -> str:
    """q4 [B,S,H,D] roped; key/value [B,Hkv,Smax,D] -> y [B,S,H*D] (GQA without repeating K/V).

    ``max_seq``: the keys' count Smax, static, or the name of a [1] int64 tensor (key/value/visible
    then hold that many keys, e.g. sliced to the longest row). ``softcap`` > 0: scores =
    softcap * tanh(scores / softcap) after the scale, before the mask (Gemma 2). ``sinks`` [H] (gpt-oss):
    one more logit per head joins each row's softmax and takes its share, then is dropped:
    p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)), m = max(max_j s_j, sink).
    """
    group = num_heads // kv_heads

    def dims(*lead: int) -> str:  # Reshape target [*lead, keys]
        if isinstance(max_seq, int):
            return g.const([*lead, max_seq])
        return g.op("Concat", g.const(list(lead)), max_seq, axis=0)

    qg = g.op("Reshape", g.op("Transpose", q4, perm=[0, 2, 1, 3]), g.const([0, kv_heads, -1, head_dim]))
    scores = g.op("MatMul", qg, g.op("Transpose", key, perm=[0, 1, 3, 2]))  # [B,Hkv,G*S,Smax]
    if dtype != "fp32":
        scores = g.op("Cast", scores, to=1)
    scores = g.op("Mul", scores, g.const(np.float32(scale)))
    if softcap:
        cap = g.const(np.float32(softcap))
        scores = g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)
    scores = g.op("Reshape", scores, dims(0, kv_heads, group, -1))
    masked = g.op("Where", g.op("Unsqueeze", visible, g.const([1])), scores, g.const(np.float32(-np.inf)))
    probs = g.op("Softmax", masked, axis=-1) if sinks is None else _softmax_with_sink(g, masked, sinks, kv_heads, dtype)
    probs = g.op("Reshape", probs, dims(0, kv_heads, -1))
    if dtype != "fp32":
        probs = g.op("Cast", probs, to=DTYPES[dtype])
    y = g.op("MatMul", probs, value)  # [B,Hkv,G*S,D]
    y = g.op("Transpose", g.op("Reshape", y, g.const([0, num_heads, -1, head_dim])), perm=[0, 2, 1, 3])
    return g.op("Reshape", y, g.const([0, 0, num_heads * head_dim]), outputs=[out])[0]


def _softmax_with_sink(g: GraphBuilder, masked: str, sinks: str, kv_heads: int, dtype: str) -> str:
    """Softmax over the last axis of masked [B,Hkv,G,S,keys] (float32) with sinks [H] in the denominator."""
    sink = g.op("Reshape", sinks if dtype == "fp32" else g.op("Cast", sinks, to=1), g.const([1, kv_heads, -1, 1, 1]))
    m = g.op("Max", g.op("ReduceMax", masked, g.const([-1]), keepdims=1), sink)
    e = g.op("Exp", g.op("Sub", masked, m))
    total = g.op("Add", g.op("ReduceSum", e, g.const([-1]), keepdims=1), g.op("Exp", g.op("Sub", sink, m)))
    return g.op("Div", e, total)


# ---- the op: shape rule, expansion body, registration --------------------------------------
def cached_attention_shapes(ins: list, attrs: dict, const) -> list:
    """y = q's shape [B,S,H*D]; present_key/value = past_key/value's [B,Hkv,Smax,D]."""
    return [list(ins[0]), list(ins[3]), list(ins[4])]


def cached_attention_expand(g: GraphBuilder, inputs, outputs, attrs: dict, ctx) -> None:
    """decodert::CachedAttention -> the reference body above (static D, Smax, R from the I/O)."""
    q, k, v, past_key, past_value, past_lengths, cos, sin = inputs
    y, present_key, present_value = outputs
    h, hkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    smax, d = ctx.static_dim(past_key, 2), ctx.static_dim(past_key, 3)
    rotary = 2 * ctx.static_dim(cos, 1)
    if h % hkv or rotary > d:
        raise ctx.error(f"num_heads {h} must be a multiple of kv_num_heads {hkv} and rotary dim {rotary} "
                        f"<= head dim {d}")
    dtype = ctx.dtype(past_key)
    actx = make_context(g, past_lengths, q, cos, sin, smax, int(attrs["sliding_window"]))
    q4 = rope_body(g, g.op("Reshape", q, g.const([0, 0, h, d])), actx, d, rotary)
    k4 = rope_body(g, g.op("Reshape", k, g.const([0, 0, hkv, d])), actx, d, rotary)
    v4 = g.op("Reshape", v, g.const([0, 0, hkv, d]))
    key = write_cache_body(g, past_key, g.op("Transpose", k4, perm=[0, 2, 1, 3]), actx, hkv, present_key)
    value = write_cache_body(g, past_value, g.op("Transpose", v4, perm=[0, 2, 1, 3]), actx, hkv, present_value)
    scale = float(attrs["scale"]) or 1.0 / float(np.sqrt(d))
    attend_body(g, q4, key, value, actx.visible, num_heads=h, kv_heads=hkv, head_dim=d, max_seq=smax, scale=scale,
                dtype=dtype, out=y)


CACHED_ATTENTION = register(
    OpDef(
        name="CachedAttention",
        inputs=("q: T [B,S,H*D]", "k: T [B,S,Hkv*D]", "v: T [B,S,Hkv*D]",
                "past_key: T [B,Hkv,Smax,D]", "past_value: T [B,Hkv,Smax,D]", "past_lengths: int64 [B]",
                "cos_cache: T [Smax,R/2]", "sin_cache: T [Smax,R/2]"),
        outputs=("y: T [B,S,H*D]", "present_key: T [B,Hkv,Smax,D] (aliases past_key)",
                 "present_value: T [B,Hkv,Smax,D] (aliases past_value)"),
        attributes={"num_heads": None, "kv_num_heads": None, "scale": 0.0, "sliding_window": 0},
        numpy_ref=cached_attention_ref,
        shape_rule=cached_attention_shapes,
        body=cached_attention_expand,
        type_input=3,
        min_outputs=3,
        aliases={1: 3, 2: 4},
        doc=__doc__ or "",
    )
)
