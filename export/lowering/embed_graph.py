"""embed.onnx: the prefill recipe's body over fresh sequences, no cache read or written, and every position's last
hidden state instead of the logits (the graph recipe: export/lowering/graph.py).

    input_ids   [B,S] int64, right-padded;  seq_lengths [B] int64 (each row's valid tokens)
    positions   arange(S) in every row (RoPE from the layer's table, as prefill with an empty cache)
    visible     [B,1,S,S]: key j of row b seen by query i iff j < seq_lengths[b] and
                  causal:         j <= i         (a sliding layer also i - j < window)
                  bidirectional:  every such j   (a sliding layer |i - j| < window // 2 + 1, transformers' Gemma 3)
                a padding query (i >= seq_lengths[b]) sees every valid key: its row is never all masked, so no NaN
                reaches the values the valid queries read (0 x NaN is NaN)
    per layer   the target's own norms, linears and MLPs (its Lowering); attention over the row's own S keys, no
                cache inputs, nothing written: the target's kernel where it takes a call without a cache
                (``Lowering.cacheless_attention``: ort's GroupQueryAttention, causal, seqlens_k = S - 1 in every
                row as in prefill), else the reference attend body (plugins/ops/cached_attention.py) with the mask
    hidden      rmsnorm(x + mlp) at every position   [B,S,hidden] float32   (the final norm, no lm_head)

Pooling, the dense layers and normalisation happen on the rows the runtime reads (runtime/embedding.py). Layers
with state beyond K/V (conv, recurrent) and layers that read another layer's cache are refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx

from decodert.errors import DecodertError
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering import per_layer
from decodert.export.lowering.graph import decoder_layer
from decodert.export.lowering.layers import attention
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.models.layers import AttentionSpec
from decodert.models.spec import ModelSpec, state_specs
from decodert.plugins.onnx_builder import GraphBuilder
from decodert.plugins.ops import cached_attention as ca

EMBED_FILE = "embed.onnx"


def embed_contract(spec: ModelSpec) -> dict[str, list[dict]]:
    """embed.onnx's inputs and outputs (the manifest's ``embedding.graph``)."""
    return {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
                       {"name": "seq_lengths", "dtype": "int64", "shape": ["batch"]}],
            "outputs": [{"name": "hidden", "dtype": "fp32", "shape": ["batch", "seq", spec.hidden_size]}]}


def embed_problem(spec: ModelSpec) -> str | None:
    """Why embed.onnx cannot be built for ``spec`` (None: it can)."""
    if state_specs(spec):
        return f"{spec.family} has layers with conv or recurrent state; embeddings need attention-only layers"
    mixers = [spec.mixer(i) for i in range(spec.num_layers)]
    if any(isinstance(m, AttentionSpec) and m.kv_source is not None for m in mixers):
        return f"{spec.family} has layers that read another layer's K/V; embeddings do not take them yet"
    return None


@dataclasses.dataclass(frozen=True)
class EmbedContext(ca.AttnContext):
    keys: str = ""  # [1] int64: S, the keys each row attends over


class EmbedLowering:
    """A target's Lowering with the attention of embed.onnx: every other op is the target's own (delegated)."""

    def __init__(self, inner: Lowering, causal: bool):
        self.inner, self.causal = inner, causal

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def for_layer(self, layer: int) -> "EmbedLowering":
        return EmbedLowering(self.inner.for_layer(layer), self.causal)

    def context(self, g: GraphBuilder, inp: GraphInputs, window: int = 0) -> Any:
        """The target's own context over an empty cache where its attention takes no cache (``inp.past_lengths``:
        zeros); else positions arange(S), the visibility rule above, RoPE at those positions ([1,S,1,R/2])."""
        if self.causal and self.inner.cacheless_attention():
            return self.inner.context(g, inp, window)
        with g.scope("embed_context"):
            seq = g.op("Gather", g.op("Shape", inp.input_ids), g.const(np.int64(1)), axis=0)
            steps = g.op("Range", g.const(np.int64(0)), seq, g.const(np.int64(1)))  # [S]
            queries = g.op("Unsqueeze", steps, g.const([0, 1, 3]))  # [1,1,S,1]
            keys = g.op("Unsqueeze", steps, g.const([0, 1, 2]))  # [1,1,1,S]
            lengths = g.op("Unsqueeze", inp.seq_lengths, g.const([1, 2, 3]))  # [B,1,1,1]
            valid = g.op("Less", keys, lengths)  # [B,1,1,S]
            rule = None
            if self.causal:
                rule = g.op("LessOrEqual", keys, queries)
                if window:
                    rule = g.op("And", rule, g.op("Greater", keys, g.op("Sub", queries, g.const(np.int64(window)))))
            elif window:
                rule = g.op("Less", g.op("Abs", g.op("Sub", queries, keys)), g.const(np.int64(window // 2 + 1)))
            if rule is not None:  # a padding query sees every valid key: never a row of no keys (NaN in its values)
                rule = g.op("Or", rule, g.op("GreaterOrEqual", queries, lengths))
            visible = valid if rule is None else g.op("And", valid, rule)
            positions = g.op("Unsqueeze", steps, g.const([0]))  # [1,S]
            cos = g.op("Unsqueeze", g.op("Gather", inp.cos_cache, positions, axis=0), g.const([2]))
            sin = g.op("Unsqueeze", g.op("Gather", inp.sin_cache, positions, axis=0), g.const([2]))
            count = g.op("Unsqueeze", seq, g.const([0]))
        return EmbedContext(positions, visible, cos, sin, count)

    def attention(self, g: GraphBuilder, ctx: EmbedContext, qkv: str, cache: tuple[str, str, str, str],
                  sinks: str | None = None) -> str:
        """qkv [B,S,(H+2Hkv)*D] -> y [B,S,H*D] over the row's own keys; ``cache`` is not read (no cache here): the
        target's kernel with no past and scratch present values, or the reference attend body."""
        low = self.inner
        if not isinstance(ctx, EmbedContext):  # cacheless_attention: causal over each row's first keys
            return low.attention(g, ctx, qkv, ("", "", "scratch_" + cache[2], "scratch_" + cache[3]), sinks)
        d, h, hkv = low.head_dim, low.attn.num_heads, low.attn.num_kv_heads
        q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
        q4 = ca.rope_body(g, g.op("Reshape", q, g.const([0, 0, h, d])), ctx, d, low.rotary_dim)
        k4 = ca.rope_body(g, g.op("Reshape", k, g.const([0, 0, hkv, d])), ctx, d, low.rotary_dim)
        v4 = g.op("Reshape", v, g.const([0, 0, hkv, d]))
        keys, values = (g.op("Transpose", t, perm=[0, 2, 1, 3]) for t in (k4, v4))  # [B,Hkv,S,D]
        return ca.attend_body(g, q4, keys, values, ctx.visible, num_heads=h, kv_heads=hkv, head_dim=d,
                              max_seq=ctx.keys, scale=low.scale, dtype=low.dtype, softcap=low.softcap, sinks=sinks)


def build_embed_graph(spec: ModelSpec, lowering: Lowering, weights: dict[str, onnx.TensorProto],
                      causal: bool = True) -> onnx.ModelProto:
    """embed.onnx over ``weights`` (the initializers prefill.onnx references: external data in weights.bin); only
    the tensors its nodes read are listed (no lm_head)."""
    problem = embed_problem(spec)
    if problem is not None:
        raise DecodertError(f"--embeddings: {problem}")
    base = lowering.for_graph("prefill")
    low = EmbedLowering(base, causal)
    g = GraphBuilder(f"decodert_{spec.family}_embed", base.opsets)
    for io in embed_contract(spec)["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    zeros = g.op("Mul", "seq_lengths", g.const(np.int64(0)))  # [B] past_lengths: no cache before the rows
    inp = GraphInputs("input_ids", zeros, "seq_lengths", "rope.cos", "rope.sin")
    with g.scope("model"):
        contexts = attention.contexts(g, low, inp, spec)
        with g.scope("embed"):
            x = base.embed(g, inp.input_ids)
            if spec.embed_scale is not None:
                x = g.op("Mul", x, g.const(np.array(spec.embed_scale, NUMPY_DTYPES[base.dtype])))
            ple = per_layer.per_layer_inputs(g, base, spec, inp.input_ids, x) if spec.per_layer_inputs else None
        h = None
        for i in range(spec.num_layers):
            with g.scope(f"layers.{i}"):
                ctx = attention.context_of(contexts, spec, i)
                x, h = decoder_layer(g, low.for_layer(i), ctx, inp, spec, i, x, h, False)
                x, h = per_layer.layer_end(g, base, spec, i, x, h, ple)
        with g.scope("final_norm"):
            rows, _ = base.add_rms_norm(g, base.tokens(g, h, spec.hidden_size), base.tokens(g, x, spec.hidden_size),
                                        "final_norm")  # [T, hidden]
        rows = rows if base.dtype == "fp32" else g.op("Cast", rows, to=1)
        hidden = g.op("Reshape", rows, g.op("Concat", g.op("Shape", inp.input_ids), g.const([spec.hidden_size]), axis=0))
    out = embed_contract(spec)["outputs"][0]
    g.output(hidden, out["name"], out["dtype"], out["shape"])
    read = {name for node in g.nodes for name in node.input}
    for name, t in weights.items():
        if name in read:
            g.add_initializer(t)
    return g.to_model(ir_version=base.ir_version)
