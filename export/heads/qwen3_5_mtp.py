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

The positions, mask, attention over the head's cache and the float32 blocks are export/heads/own_kv.py's. The MLP
is the target's kind: SwiGLU (qwen3_5), or (qwen3_5_moe) the router's top-k experts, every expert run under the top-k
mask (plugins/ops/moe.py ``masked_body``), plus the shared expert x sigmoid(m @ shared_gate^T).
Attention, norms and residuals run in float32; the linear weights are stored in the head's dtype.
"""

from __future__ import annotations

import numpy as np
import onnx

from decodert.export.heads.own_kv import (ONNX_FLOAT, HeadOps, add_weights, attend, cache_inputs, cache_outputs,
                                          last_rows, positions, rope)
from decodert.models.families.qwen3_5 import MtpSpec
from decodert.export.quantize.quant import QuantConfig
from decodert.plugins.onnx_builder import GraphBuilder
from decodert.plugins.ops import moe as moe_op


def mtp_contract(spec: MtpSpec, dtype: str) -> dict[str, list[dict]]:
    """head.onnx's inputs and outputs (the head manifest's ``graph``)."""
    h, kv, d = spec.hidden_size, spec.num_kv_heads, spec.head_dim
    inputs = [{"name": "token_embeds", "dtype": dtype, "shape": ["batch", "seq", h]},
              {"name": "hidden", "dtype": dtype, "shape": ["batch", "seq", h]}, *cache_inputs(dtype, kv, d)]
    outputs = [{"name": "logits", "dtype": "fp32", "shape": ["batch", spec.vocab_size]},
               {"name": "next_token", "dtype": "int64", "shape": ["batch"]},
               {"name": "hidden_out", "dtype": dtype, "shape": ["batch", h]}, *cache_outputs(dtype, kv, d)]
    return {"inputs": inputs, "outputs": outputs}


LINEARS = ("fc", "q", "k", "v", "o", "gate", "up", "down", "shared.gate", "shared.up", "shared.down", "lm_head")


def build_mtp_graph(spec: MtpSpec, weights: dict[str, np.ndarray], dtype: str, max_seq: int,
                    quant: QuantConfig | None = None) -> onnx.ModelProto:
    """The graph above; ``weights``: canonical name (MTP_WEIGHTS) -> float32 array, norms already (1 + w).
    ``quant``: the linears (``LINEARS`` present; lm_head, the target's, unless ``quant.lm_head`` is false)
    block-quantized (MatMulNBits); the router, the shared expert's gate row and the experts stay float."""
    g = GraphBuilder("decodert_qwen3_5_mtp_head", {"": 21, "com.microsoft": 1} if quant else {"": 21})
    contract = mtp_contract(spec, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    linears = frozenset(n for n in LINEARS if quant is not None and n in weights and (n != "lm_head" or quant.lm_head))
    ops = HeadOps(g, dtype, spec.rms_norm_eps, quant, add_weights(g, weights, dtype, quant, linears))
    norm, linear = ops.norm, ops.linear
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    rot = spec.rope.rotary_dim or spec.head_dim
    p = positions(g, spec.rope, d, max_seq, "token_embeds")

    with g.scope("fc"):
        e, h = norm(ops.f32("token_embeds"), "embed_norm"), norm(ops.f32("hidden"), "hidden_norm")
        x = linear(g.op("Concat", e, h, axis=-1), "fc")  # [B, S, hidden]
    with g.scope("layers.0"):
        a = norm(x, "input_norm")
        qg = g.op("Reshape", linear(a, "q"), g.const([0, 0, heads, 2 * d]))  # [B, S, H, 2D] per head [query | gate]
        q, gate = g.op("Split", qg, g.const([d, d]), axis=-1, outputs=2)
        q = rope(g, norm(q, "q_norm"), p, rot, d)  # [B, S, H, D]
        k = rope(g, norm(g.op("Reshape", linear(a, "k"), g.const([0, 0, kv, d])), "k_norm"), p, rot, d)
        v = g.op("Reshape", linear(a, "v"), g.const([0, 0, kv, d]))
        att, k_new, v_new = attend(ops, q, k, v, p, heads, kv, d)
        att = g.op("Mul", att, g.op("Sigmoid", g.op("Reshape", gate, g.const([0, 0, heads * d]))))
        x = g.op("Add", x, linear(att, "o"))
        m = norm(x, "post_norm")
        x = g.op("Add", x, _mlp(g, spec, m, ops, dtype) if spec.moe is not None
                 else linear(ops.silu_times(linear(m, "gate"), linear(m, "up")), "down"))
    out = norm(x, "final_norm")  # [B, S, hidden]
    last = last_rows(g, out, p, spec.hidden_size)  # [B, hidden]
    with g.scope("lm_head"):
        logits = linear(last, "lm_head")  # [B, V]
    g.output(logits, "logits", "fp32", ["batch", spec.vocab_size])
    g.output(g.op("ArgMax", logits, axis=-1, keepdims=0), "next_token", "int64", ["batch"])
    g.output(ops.stored(last), "hidden_out", dtype, ["batch", spec.hidden_size])
    g.output(k_new, "new_key.0", dtype, ["batch", kv, "seq", d])
    g.output(v_new, "new_value.0", dtype, ["batch", kv, "seq", d])
    return g.to_model(ir_version=10)


def _mlp(g: GraphBuilder, spec: MtpSpec, m: str, ops: HeadOps, dtype: str) -> str:
    """A MoE target's MTP MLP on m [B, S, hidden] (float32): the router's top-k experts (plugins/ops/moe.py, every
    expert under the top-k mask) plus the shared expert x sigmoid(m @ shared_gate^T)."""
    moe, linear = spec.moe, ops.linear
    with g.scope("moe"):
        flat = g.op("Reshape", m, g.const([-1, spec.hidden_size]))  # [T, hidden]
        to = None if dtype == "fp32" else ONNX_FLOAT[dtype]  # the experts compute in the head's dtype
        weights, idx = moe_op.route(g, linear(flat, "router"), moe.experts_per_token, moe.renormalize, to)
        y = moe_op.masked_body(g, flat if to is None else g.op("Cast", flat, to=to), weights, idx, moe.num_experts,
                               moe.expert_size, "experts.gate_up", "experts.down",
                               lambda gb, a: gb.op("Mul", a, gb.op("Sigmoid", a)))
        y = y if to is None else g.op("Cast", y, to=1)
        shared = linear(ops.silu_times(linear(flat, "shared.gate"), linear(flat, "shared.up")), "shared.down")
        shared = g.op("Mul", shared, g.op("Sigmoid", linear(flat, "shared_gate")))
        return g.op("Reshape", g.op("Add", y, shared), g.op("Shape", m))
