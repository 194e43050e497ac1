"""head.onnx of a Qwen3.5 MTP layer (the step models/families/qwen3_5.py ``MTP_WEIGHTS`` describes), standard ONNX ops.

One call runs S pairs per row at positions M..M+S-1 (a catch-up over the positions the target computed since the
head's last call, or one chained draft step), over the head's own cache of earlier positions:

    token_embeds [B, S, hidden]   the target's embedding of the token after each position (runtime: rows of the
                                  target's weights.bin, runtime/speculation/mtp.py)
    hidden       [B, S, hidden]   the target's hidden state at each position (or the head's previous hidden_out)
    past_lengths [B] int64        M: the position of the row's first pair (the head's entries it reads end there)
    past_starts  [B] int64        the first position the head holds an entry for (keys before it are not read)
    seq_lengths  [B] int64        pairs of the row that are real (the rest pad the batch)
    past_key.0 / past_value.0 [B, H_kv, P, D]   the head's cache, positions 0..P-1 (P >= max M; read only)
  ->
    logits [B, V] float32, next_token [B] int64, hidden_out [B, hidden]   at each row's last real pair
    new_key.0 / new_value.0 [B, H_kv, S, D]   the K/V of the pairs fed (RoPE'd keys), which the head's cache
                                              owner writes at M..M+S-1 (runtime/speculation/mtp.py ``HeadCache``)

    embeds --norm--+                          past K/V [B,Hkv,P,D] --Concat(new K/V)--> [B,Hkv,P+S,D]
                   +--Concat--fc--> x --norm--q/k/v--qk norm--RoPE--attention(mask)--*sigmoid(gate)--o--+x
    hidden --norm--+                                  --norm--gate/up--silu*--down--+x --mtp.norm--> h' --lm_head

A key j < P is visible to a query of the row iff start <= j < M; a key fed with the call (position M+s') iff s' <= s.
The MLP is the target's kind: SwiGLU (qwen3_5), or (qwen3_5_moe) the router's top-k experts, every expert run under
the top-k mask (plugins/ops/moe.py ``masked_body``), plus the shared expert x sigmoid(m @ shared_gate^T).
Attention, norms and residuals run in float32; the linear weights are stored in the head's dtype.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from decodert.models.families.qwen3_5 import MtpSpec
from decodert.plugins.onnx_builder import GraphBuilder
from decodert.plugins.ops import moe as moe_op

NP = {"fp32": np.float32, "fp16": np.float16}
ONNX_FLOAT = {"fp32": 1, "fp16": 10}
CACHE = ("key", "value")


def mtp_contract(spec: MtpSpec, dtype: str) -> dict[str, list[dict]]:
    """head.onnx's inputs and outputs (the head manifest's ``graph``)."""
    h, kv, d = spec.hidden_size, spec.num_kv_heads, spec.head_dim
    inputs = [{"name": "token_embeds", "dtype": dtype, "shape": ["batch", "seq", h]},
              {"name": "hidden", "dtype": dtype, "shape": ["batch", "seq", h]},
              {"name": "past_lengths", "dtype": "int64", "shape": ["batch"]},
              {"name": "past_starts", "dtype": "int64", "shape": ["batch"]},
              {"name": "seq_lengths", "dtype": "int64", "shape": ["batch"]}]
    inputs += [{"name": f"past_{n}.0", "dtype": dtype, "shape": ["batch", kv, "past", d]} for n in CACHE]
    outputs = [{"name": "logits", "dtype": "fp32", "shape": ["batch", spec.vocab_size]},
               {"name": "next_token", "dtype": "int64", "shape": ["batch"]},
               {"name": "hidden_out", "dtype": dtype, "shape": ["batch", h]}]
    outputs += [{"name": f"new_{n}.0", "dtype": dtype, "shape": ["batch", kv, "seq", d]} for n in CACHE]
    return {"inputs": inputs, "outputs": outputs}


def build_mtp_graph(spec: MtpSpec, weights: dict[str, np.ndarray], dtype: str, max_seq: int) -> onnx.ModelProto:
    """The graph above; ``weights``: canonical name (MTP_WEIGHTS) -> float32 array, norms already (1 + w)."""
    g = GraphBuilder("decodert_qwen3_5_mtp_head", {"": 21})
    contract = mtp_contract(spec, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    f = NP[dtype]
    for name, w in weights.items():
        if name.endswith("norm"):  # norms in float32
            g.add_initializer(numpy_helper.from_array(w.astype(np.float32).reshape(-1), name))
        elif name.startswith("experts."):  # [E, rows, in] as plugins/ops/moe.py takes them
            g.add_initializer(numpy_helper.from_array(w.astype(f), name))
        else:  # a linear weight [out, in] stored transposed for MatMul
            g.add_initializer(numpy_helper.from_array(np.ascontiguousarray(w.T).astype(f), name))
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    group, rot = heads // kv, spec.rope.rotary_dim or spec.head_dim
    cos, sin = spec.rope.cos_sin(d, max_seq)  # [max_seq, rot/2]
    g.add_initializer(numpy_helper.from_array(np.concatenate([cos, cos], -1).astype(np.float32), "rope.cos"))
    g.add_initializer(numpy_helper.from_array(np.concatenate([sin, sin], -1).astype(np.float32), "rope.sin"))

    def norm(x: str, weight: str) -> str:  # float32 in, float32 out
        ms = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
        y = g.op("Mul", x, g.op("Pow", g.op("Add", ms, g.const(np.float32(spec.rms_norm_eps))), g.const(np.float32(-0.5))))
        return g.op("Mul", y, weight)

    def linear(x: str, weight: str) -> str:  # float32 [.., in] -> float32 [.., out]
        y = g.op("MatMul", x if dtype == "fp32" else g.op("Cast", x, to=ONNX_FLOAT[dtype]), weight)
        return y if dtype == "fp32" else g.op("Cast", y, to=1)

    def f32(x: str) -> str:
        return x if dtype == "fp32" else g.op("Cast", x, to=1)

    def stored(x: str) -> str:
        return x if dtype == "fp32" else g.op("Cast", x, to=ONNX_FLOAT[dtype])

    def rope(x: str, cos: str, sin: str) -> str:  # [B, S, n, D]: the first rot dims rotated (rotate-half)
        part, rest = g.op("Split", x, g.const([rot, d - rot]), axis=-1, outputs=2) if rot < d else (x, None)
        lo, hi = g.op("Split", part, g.const([rot // 2, rot // 2]), axis=-1, outputs=2)
        y = g.op("Add", g.op("Mul", part, cos), g.op("Mul", g.op("Concat", g.op("Neg", hi), lo, axis=-1), sin))
        return y if rest is None else g.op("Concat", y, rest, axis=-1)

    shape = g.op("Shape", "token_embeds")
    batch, seq = (g.op("Slice", shape, g.const([i]), g.const([i + 1])) for i in (0, 1))  # [1] each
    s = g.op("Range", g.const(np.int64(0)), g.op("Squeeze", seq, g.const([0])), g.const(np.int64(1)))  # [S]
    starts, ends = g.op("Unsqueeze", "past_starts", g.const([1])), g.op("Unsqueeze", "past_lengths", g.const([1]))
    pos = g.op("Add", ends, g.op("Unsqueeze", s, g.const([0])))  # [B, S] each pair's position
    pos = g.op("Min", pos, g.const(np.int64(max_seq - 1)))  # a padded pair's, kept inside the table
    cos = g.op("Unsqueeze", g.op("Gather", "rope.cos", pos, axis=0), g.const([2]))  # [B, S, 1, rot]
    sin = g.op("Unsqueeze", g.op("Gather", "rope.sin", pos, axis=0), g.const([2]))
    past = g.op("Slice", g.op("Shape", "past_key.0"), g.const([2]), g.const([3]))  # [1] P
    j = g.op("Unsqueeze", g.op("Range", g.const(np.int64(0)), g.op("Squeeze", past, g.const([0])),
                               g.const(np.int64(1))), g.const([0]))  # [1, P]
    held = g.op("And", g.op("GreaterOrEqual", j, starts), g.op("Less", j, ends))  # [B, P]
    held = g.op("Expand", g.op("Unsqueeze", held, g.const([1])), g.op("Concat", batch, seq, past, axis=0))  # [B,S,P]
    causal = g.op("LessOrEqual", g.op("Unsqueeze", s, g.const([0])), g.op("Unsqueeze", s, g.const([1])))  # [S, S]
    causal = g.op("Expand", g.op("Unsqueeze", causal, g.const([0])), g.op("Concat", batch, seq, seq, axis=0))
    visible = g.op("Concat", held, causal, axis=-1)  # [B, S, P+S]
    mask = g.op("Unsqueeze", g.op("Where", visible, g.const(np.float32(0)), g.const(np.float32(-1e30))),
                g.const([1, 2]))  # [B, 1, 1, S, P+S]

    with g.scope("fc"):
        e, h = norm(f32("token_embeds"), "embed_norm"), norm(f32("hidden"), "hidden_norm")
        x = linear(g.op("Concat", e, h, axis=-1), "fc")  # [B, S, hidden]
    with g.scope("layers.0"):
        a = norm(x, "input_norm")
        qg = g.op("Reshape", linear(a, "q"), g.const([0, 0, heads, 2 * d]))  # [B, S, H, 2D] per head [query | gate]
        q, gate = g.op("Split", qg, g.const([d, d]), axis=-1, outputs=2)
        q = rope(norm(q, "q_norm"), cos, sin)  # [B, S, H, D]
        k = rope(norm(g.op("Reshape", linear(a, "k"), g.const([0, 0, kv, d])), "k_norm"), cos, sin)  # [B, S, Hkv, D]
        v = g.op("Reshape", linear(a, "v"), g.const([0, 0, kv, d]))
        k_new, v_new = (stored(g.op("Transpose", t, perm=[0, 2, 1, 3])) for t in (k, v))  # [B, Hkv, S, D]
        keys = g.op("Concat", f32("past_key.0"), f32(k_new), axis=2)  # [B, Hkv, P+S, D] as the cache holds them
        values = g.op("Concat", f32("past_value.0"), f32(v_new), axis=2)
        q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 1, 3]), g.const([0, kv, group, -1, d]))  # [B,Hkv,G,S,D]
        scores = g.op("MatMul", g.op("Mul", q, g.const(np.float32(d ** -0.5))),
                      g.op("Unsqueeze", g.op("Transpose", keys, perm=[0, 1, 3, 2]), g.const([2])))  # [B,Hkv,G,S,P+S]
        att = g.op("MatMul", g.op("Softmax", g.op("Add", scores, mask), axis=-1),
                   g.op("Unsqueeze", values, g.const([2])))  # [B, Hkv, G, S, D]
        att = g.op("Reshape", g.op("Transpose", att, perm=[0, 3, 1, 2, 4]), g.const([0, 0, heads * d]))  # [B,S,H*D]
        att = g.op("Mul", att, g.op("Sigmoid", g.op("Reshape", gate, g.const([0, 0, heads * d]))))
        x = g.op("Add", x, linear(att, "o"))
        m = norm(x, "post_norm")
        x = g.op("Add", x, _mlp(g, spec, m, linear, dtype) if spec.moe is not None
                 else linear(_silu_times(g, linear(m, "gate"), linear(m, "up")), "down"))
    out = norm(x, "final_norm")  # [B, S, hidden]
    rows = g.op("Add", g.op("Mul", g.op("Range", g.const(np.int64(0)), g.op("Squeeze", batch, g.const([0])),
                                        g.const(np.int64(1))), g.op("Squeeze", seq, g.const([0]))),
                g.op("Sub", "seq_lengths", g.const(np.int64(1))))  # [B] b*S + n_b - 1
    last = g.op("Gather", g.op("Reshape", out, g.const([-1, spec.hidden_size])), rows, axis=0)  # [B, hidden]
    with g.scope("lm_head"):
        logits = linear(last, "lm_head")  # [B, V]
    g.output(logits, "logits", "fp32", ["batch", spec.vocab_size])
    g.output(g.op("ArgMax", logits, axis=-1, keepdims=0), "next_token", "int64", ["batch"])
    g.output(stored(last), "hidden_out", dtype, ["batch", spec.hidden_size])
    g.output(k_new, "new_key.0", dtype, ["batch", kv, "seq", d])
    g.output(v_new, "new_value.0", dtype, ["batch", kv, "seq", d])
    return g.to_model(ir_version=10)


def _silu_times(g: GraphBuilder, gate: str, up: str) -> str:
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)


def _mlp(g: GraphBuilder, spec: MtpSpec, m: str, linear, dtype: str) -> str:
    """A MoE target's MTP MLP on m [B, S, hidden] (float32): the router's top-k experts (plugins/ops/moe.py, every
    expert under the top-k mask) plus the shared expert x sigmoid(m @ shared_gate^T)."""
    moe = spec.moe
    with g.scope("moe"):
        flat = g.op("Reshape", m, g.const([-1, spec.hidden_size]))  # [T, hidden]
        to = None if dtype == "fp32" else ONNX_FLOAT[dtype]  # the experts compute in the head's dtype
        weights, idx = moe_op.route(g, linear(flat, "router"), moe.experts_per_token, moe.renormalize, to)
        y = moe_op.masked_body(g, flat if to is None else g.op("Cast", flat, to=to), weights, idx, moe.num_experts,
                               moe.expert_size, "experts.gate_up", "experts.down",
                               lambda gb, a: gb.op("Mul", a, gb.op("Sigmoid", a)))
        y = y if to is None else g.op("Cast", y, to=1)
        shared = linear(_silu_times(g, linear(flat, "shared.gate"), linear(flat, "shared.up")), "shared.down")
        shared = g.op("Mul", shared, g.op("Sigmoid", linear(flat, "shared_gate")))
        return g.op("Reshape", g.op("Add", y, shared), g.op("Shape", m))
