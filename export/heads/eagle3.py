"""head.onnx of an EAGLE-3 head (the step models/families/eagle3.py describes), standard ONNX ops.

One call runs S pairs per row at positions M..M+S-1 (a catch-up over the positions the target computed since the
head's last call, or one chained draft step) over the head's own cache (export/heads/own_kv.py):

    token_embeds [B, S, hidden]      the embedding of the token after each position (the head's embed_tokens, else
                                     the target's: rows the runtime reads, runtime/speculation/mtp.py)
    features     [B, S, 3 target_hidden]   the target's three layer inputs at each position (a catch-up; zeros in
                                     a chained step)
    hidden       [B, S, hidden]      the head's previous pre-norm output g (a chained step; zeros in a catch-up)
    past_lengths, past_starts, seq_lengths, past_key.0 / past_value.0   own_kv.py's
  ->
    logits [B, draft_vocab] float32, next_token [B] int64 (the target's id: argmax + d2t[argmax]),
    hidden_out [B, hidden] (g at each row's last real pair), new_key.0 / new_value.0 [B, H_kv, S, D]

    features --fc--+ (+ hidden) = x --hidden_norm--+
                                                   +--Concat [2 hidden]--q/k/v--RoPE--attention(mask)--o--+x = r
    embeds --input_layernorm-----------------------+           --post_attention_layernorm--gate/up--silu*--down--+r
                                                                                  = g --norm--lm_head--argmax+d2t

fc has no bias, so fc(0) + g is g exactly: one graph serves both kinds of call without a branch.
"""

from __future__ import annotations

import numpy as np
import onnx

from decodert.export.heads.own_kv import HeadOps, add_weights, attend, cache_inputs, cache_outputs, last_rows, positions, rope
from decodert.export.quantize.quant import QuantConfig
from decodert.models.families.eagle3 import Eagle3Spec
from decodert.plugins.onnx_builder import GraphBuilder


def eagle3_contract(spec: Eagle3Spec, dtype: str) -> dict[str, list[dict]]:
    """head.onnx's inputs and outputs (the head manifest's ``graph``)."""
    h, kv, d = spec.hidden_size, spec.num_kv_heads, spec.head_dim
    inputs = [{"name": "token_embeds", "dtype": dtype, "shape": ["batch", "seq", h]},
              {"name": "features", "dtype": dtype, "shape": ["batch", "seq", 3 * spec.target_hidden_size]},
              {"name": "hidden", "dtype": dtype, "shape": ["batch", "seq", h]}, *cache_inputs(dtype, kv, d)]
    outputs = [{"name": "logits", "dtype": "fp32", "shape": ["batch", spec.draft_vocab_size]},
               {"name": "next_token", "dtype": "int64", "shape": ["batch"]},
               {"name": "hidden_out", "dtype": dtype, "shape": ["batch", h]}, *cache_outputs(dtype, kv, d)]
    return {"inputs": inputs, "outputs": outputs}


LINEARS = ("fc", "q", "k", "v", "o", "gate", "up", "down", "lm_head")


def build_eagle3_graph(spec: Eagle3Spec, weights: dict[str, np.ndarray], dtype: str, max_seq: int,
                       quant: QuantConfig | None = None) -> onnx.ModelProto:
    """The graph above; ``weights``: canonical name (eagle3.HF_WEIGHTS, embed and t2d left out) -> float32 array,
    d2t int64 (absent: the draft vocabulary is the target's). ``quant``: the linears block-quantized (MatMulNBits;
    lm_head too unless ``quant.lm_head`` is false)."""
    g = GraphBuilder("decodert_eagle3_head", {"": 21, "com.microsoft": 1} if quant else {"": 21})
    for io in eagle3_contract(spec, dtype)["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    linears = frozenset(n for n in LINEARS if quant is not None and (n != "lm_head" or quant.lm_head))
    ops = HeadOps(g, dtype, spec.rms_norm_eps, quant, add_weights(g, weights, dtype, quant, linears))
    norm, linear = ops.norm, ops.linear
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    p = positions(g, spec.rope, d, max_seq, "token_embeds")

    with g.scope("fc"):
        x = g.op("Add", linear(ops.f32("features"), "fc"), ops.f32("hidden"))  # [B, S, hidden]
    with g.scope("midlayer"):
        e, hn = norm(ops.f32("token_embeds"), "embed_norm"), norm(x, "hidden_norm")
        a = g.op("Concat", e, hn, axis=-1)  # [B, S, 2 hidden]
        q = rope(g, g.op("Reshape", linear(a, "q"), g.const([0, 0, heads, d])), p, d, d)  # [B, S, H, D]
        k = rope(g, g.op("Reshape", linear(a, "k"), g.const([0, 0, kv, d])), p, d, d)  # [B, S, Hkv, D]
        v = g.op("Reshape", linear(a, "v"), g.const([0, 0, kv, d]))
        att, k_new, v_new = attend(ops, q, k, v, p, heads, kv, d)
        r = g.op("Add", hn if spec.norm_before_residual else x, linear(att, "o"))
        m = norm(r, "post_norm")
        out = g.op("Add", r, linear(ops.silu_times(linear(m, "gate"), linear(m, "up")), "down"))  # g [B, S, hidden]
    last = last_rows(g, out, p, spec.hidden_size)  # [B, hidden]
    with g.scope("lm_head"):
        logits = linear(norm(last, "final_norm"), "lm_head")  # [B, draft_vocab]
    best = g.op("ArgMax", logits, axis=-1, keepdims=0)  # [B] a draft id
    token = g.op("Add", best, g.op("Gather", "d2t", best, axis=0)) if "d2t" in weights else best
    g.output(logits, "logits", "fp32", ["batch", spec.draft_vocab_size])
    g.output(token, "next_token", "int64", ["batch"])
    g.output(ops.stored(last), "hidden_out", dtype, ["batch", spec.hidden_size])
    g.output(k_new, "new_key.0", dtype, ["batch", kv, "seq", d])
    g.output(v_new, "new_value.0", dtype, ["batch", kv, "seq", d])
    return g.to_model(ir_version=10)
