"""head.onnx of a Gemma 4 assistant (the step models/families/gemma4_assistant.py describes), standard ONNX ops.

    token_embeds [B, backbone]   the target's scaled embedding of each row's pending token (runtime: rows of the
                                 target's weights.bin, runtime/speculation/heads.py)
    hidden       [B, backbone]   the target's hidden state that chose it (or the previous step's hidden_out)
    past_lengths [B] int64       L: positions the row's target cache holds; the query's position
    past_key.{i} / past_value.{i} [B, H_kv, max_seq, D]   the target's cache of the layers the head reads
                                 (source_layers), read only, bound in place from the target's KVCache
  ->
    logits [B, V] float32, next_token [B] int64, hidden_out [B, backbone]

Attention runs in float32 over the first max(L) positions: key j visible iff j < L (sliding layers also
L - 1 - j <= window, transformers' bidirectional window seen from the last position).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from decodert.export.heads.own_kv import NP, ONNX_FLOAT, HeadOps, add_weights
from decodert.export.quantize.quant import QuantConfig
from decodert.models.families.gemma4_assistant import AssistantSpec
from decodert.plugins.onnx_builder import GraphBuilder


def head_contract(spec: AssistantSpec, sources: dict[str, int], dims: dict[int, int], dtype: str,
                  max_seq: int) -> dict[str, list[dict]]:
    """head.onnx's inputs and outputs (the head manifest's ``graph``); ``dims``: each read target layer's D."""
    b = spec.backbone_hidden_size
    inputs = [{"name": "token_embeds", "dtype": dtype, "shape": ["batch", b]},
              {"name": "hidden", "dtype": dtype, "shape": ["batch", b]},
              {"name": "past_lengths", "dtype": "int64", "shape": ["batch"]}]
    for i in sorted(set(sources.values())):
        for name in ("key", "value"):
            inputs.append({"name": f"past_{name}.{i}", "dtype": dtype,
                           "shape": ["batch", spec.num_kv_heads, max_seq, dims[i]]})
    outputs = [{"name": "logits", "dtype": "fp32", "shape": ["batch", spec.vocab_size]},
               {"name": "next_token", "dtype": "int64", "shape": ["batch"]},
               {"name": "hidden_out", "dtype": dtype, "shape": ["batch", b]}]
    return {"inputs": inputs, "outputs": outputs}


LINEARS = ("pre_projection", "post_projection", "q", "o", "gate", "up", "down")  # a layer's as layers.{i}.NAME


def build_head_graph(spec: AssistantSpec, weights: dict[str, np.ndarray], sources: dict[str, int],
                     dims: dict[int, int], dtype: str, max_seq: int, quant: QuantConfig | None = None) -> onnx.ModelProto:
    """The graph above; ``weights``: canonical name -> float32 array (models/families/gemma4_assistant.weight_names).
    ``quant``: the linears (``LINEARS``) block-quantized (MatMulNBits); the embedding, which the logits read as the
    lm_head (tied), and the centroids stay in the head's dtype."""
    g = GraphBuilder("decodert_gemma4_assistant_head", {"": 21, "com.microsoft": 1} if quant else {"": 21})
    contract = head_contract(spec, sources, dims, dtype, max_seq)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    own = {"token_ordering", "embed"}  # written here; every other weight as add_weights writes a head's
    for name in own & weights.keys():
        w = weights[name]
        if name == "token_ordering":
            g.add_initializer(numpy_helper.from_array(w.astype(np.int64).reshape(spec.num_centroids, -1), name))
        else:  # [V, hidden] as it is: gathered (ordered logits) and multiplied transposed
            g.add_initializer(numpy_helper.from_array(w.astype(NP[dtype]), name))
    for name in (n for n in weights if n.endswith("layer_scalar")):  # scalars in float32 (transformers: .float())
        g.add_initializer(numpy_helper.from_array(weights[name].astype(np.float32).reshape(-1), name))
    rest = {n: w for n, w in weights.items() if n not in own and not n.endswith("layer_scalar")}
    linears = frozenset(n for n in rest if quant is not None and n.rsplit(".", 1)[-1] in LINEARS)
    ops = HeadOps(g, dtype, spec.rms_norm_eps, quant, add_weights(g, rest, dtype, quant, linears))
    for kind, rope in (("full_attention", spec.rope), ("sliding_attention", spec.local_rope)):
        dim = next((d for k, d in zip(spec.kinds, spec.head_dims) if k == kind), None)
        if dim is not None:
            cos, sin = rope.cos_sin(dim, max_seq + 1)  # [P, D/2]
            g.add_initializer(numpy_helper.from_array(np.concatenate([cos, cos], -1), f"rope.{kind}.cos"))
            g.add_initializer(numpy_helper.from_array(np.concatenate([sin, sin], -1), f"rope.{kind}.sin"))

    norm, linear, f32 = ops.norm, ops.linear, ops.f32

    lengths = "past_lengths"
    keys = g.op("ReduceMax", lengths, g.const([0]), keepdims=1)  # [1] the positions any row reads
    j = g.op("Range", g.const(np.int64(0)), g.op("Squeeze", keys, g.const([0])), g.const(np.int64(1)))  # [K]
    j = g.op("Unsqueeze", j, g.const([0]))  # [1, K]
    last = g.op("Sub", g.op("Unsqueeze", lengths, g.const([1])), g.const(np.int64(1)))  # [B, 1] L - 1
    seen = g.op("Less", j, g.op("Unsqueeze", lengths, g.const([1])))  # [B, K]
    near = g.op("And", seen, g.op("LessOrEqual", g.op("Sub", last, j), g.const(np.int64(spec.window))))
    neg = g.const(np.float32(-1e30))
    masks = {k: g.op("Unsqueeze", g.op("Where", m, g.const(np.float32(0)), neg), g.const([1, 2]))  # [B,1,1,K]
             for k, m in (("full_attention", seen), ("sliding_attention", near))}

    with g.scope("pre_projection"):
        x = linear(g.op("Concat", f32("token_embeds"), f32("hidden"), axis=-1), "pre_projection")  # [B, hidden]
    heads, kv, group = spec.num_heads, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    for i, kind in enumerate(spec.kinds):
        p, d, src = f"layers.{i}.", spec.head_dims[i], sources[kind]
        with g.scope(f"layers.{i}"):
            h = norm(x, p + "input_norm")
            q = g.op("Reshape", linear(h, p + "q"), g.const([0, heads, d]))  # [B, H, D]
            q = norm(q, p + "q_norm")
            cos = g.op("Unsqueeze", g.op("Gather", f"rope.{kind}.cos", lengths, axis=0), g.const([1]))  # [B,1,D]
            sin = g.op("Unsqueeze", g.op("Gather", f"rope.{kind}.sin", lengths, axis=0), g.const([1]))
            lo, hi = g.op("Split", q, g.const([d // 2, d // 2]), axis=-1, outputs=2)
            q = g.op("Add", g.op("Mul", q, cos), g.op("Mul", g.op("Concat", g.op("Neg", hi), lo, axis=-1), sin))
            q = g.op("Reshape", q, g.const([0, kv, group, d]))  # [B, Hkv, G, D]
            k = f32(g.op("Slice", f"past_key.{src}", g.const([0]), keys, g.const([2])))  # [B, Hkv, K, D]
            v = f32(g.op("Slice", f"past_value.{src}", g.const([0]), keys, g.const([2])))
            scores = g.op("Add", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), masks[kind])
            a = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # [B, Hkv, G, D]
            a = linear(g.op("Reshape", a, g.const([0, heads * d])), p + "o")
            x = g.op("Add", x, norm(a, p + "attn_out_norm"))
            h = norm(x, p + "post_norm")
            gate, up = linear(h, p + "gate"), linear(h, p + "up")
            m = linear(g.op("Mul", g.op("Gelu", gate, approximate="tanh"), up), p + "down")
            x = g.op("Mul", g.op("Add", x, norm(m, p + "mlp_out_norm")), p + "layer_scalar")
    h = norm(x, "final_norm")
    hidden_out = linear(h, "post_projection")
    with g.scope("lm_head"):
        hd = h if dtype == "fp32" else g.op("Cast", h, to=ONNX_FLOAT[dtype])
        logits = _ordered_logits(g, spec, hd) if spec.ordered else g.op("MatMul", hd, g.op("Transpose", "embed"))
        logits = f32(logits)
    g.output(logits, "logits", "fp32", ["batch", spec.vocab_size])
    g.output(g.op("ArgMax", logits, axis=-1, keepdims=0), "next_token", "int64", ["batch"])
    g.output(hidden_out if dtype == "fp32" else g.op("Cast", hidden_out, to=ONNX_FLOAT[dtype]), "hidden_out", dtype,
             ["batch", spec.backbone_hidden_size])
    return g.to_model(ir_version=10)


def _ordered_logits(g: GraphBuilder, spec: AssistantSpec, h: str) -> str:
    """The masked embedder: scores for the tokens of the top-k centroids (their rows of lm_head), every other token
    the row's lowest score - 1 (transformers' Gemma4AssistantMaskedEmbedder takes its batch's lowest: the same for
    one row; per row here, so a row's drafts do not depend on the rows beside it)."""
    per = spec.vocab_size // spec.num_centroids
    centroid = g.op("MatMul", h, "centroids")  # [B, C]
    _, top = g.op("TopK", centroid, g.const([spec.top_k]), axis=-1, outputs=2)  # [B, k]
    tokens = g.op("Reshape", g.op("Gather", "token_ordering", top, axis=0), g.const([0, spec.top_k * per]))  # [B, N]
    rows = g.op("Gather", "embed", tokens, axis=0)  # [B, N, hidden]
    scores = g.op("Squeeze", g.op("MatMul", rows, g.op("Unsqueeze", h, g.const([2]))), g.const([2]))  # [B, N]
    low = g.op("Sub", g.op("ReduceMin", scores, g.const([-1]), keepdims=1), g.op("CastLike", g.const(np.float32(1)), scores))
    full = g.op("Expand", low, g.op("Concat", g.op("Slice", g.op("Shape", h), g.const([0]), g.const([1])),
                                    g.const([spec.vocab_size]), axis=0))  # [B, V]
    return g.op("ScatterElements", full, tokens, scores, axis=1)
