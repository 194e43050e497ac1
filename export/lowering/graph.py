"""One transformer graph recipe, parameterised by ModelSpec and a target Lowering.

    input_ids [B,S] --Gather(embed)--> x [T=B*S, hidden]   ([B,S,hidden] where lowering.flat_tokens is False)
                          x * embed_scale                  (Gemma: sqrt(hidden) in the graph dtype)
    M-RoPE (spec.mrope_section, Qwen-VL): input rope_offsets [3,B,S] turns every layer's RoPE by 3-D positions
                                                           (plugins/ops/mrope.py; default zeros = 1-D positions)
    prefill of a vision-language model (spec.image_token_id):
        x[image_positions] = image_embeds                  ScatterND over the [B*S, hidden] rows; image_positions
                                                           [N] = b*S + s of each image token, image_embeds [N, hidden]
                                                           (vision.onnx's output rows); both default to empty
        Qwen3-VL (spec.deepstack_layers = n): after layer i < n, x[image_positions] += deepstack_embeds[i]
        ahead[image_positions] = image_ahead               spec.bidirectional_images (Gemma 3): [N] how many later
                                                           tokens of its own image each image token also sees;
                                                           ahead [B,S] (0 elsewhere) widens the causal mask:
                                                           key j visible to query i iff j <= pos_i + ahead_i
    per layer i:
        h      = rmsnorm(x)                                (fused with the residual add below)
        qkv    = h @ qkv^T (+ bias)                        [T, (H+2Hkv)*D]   (q/k rmsnorm: Qwen3, Gemma 3)
        attn   = CachedAttention(qkv, past/present.i)      [B,S,H*D]  writes K/V in place; the layer's
                                                           window and RoPE table (spec.layer_window/_rope)
        a      = attn @ o^T                                (sandwich_norm: a = rmsnorm(a))
        x, h   = x + a,  rmsnorm(x + a)
        m      = down(act(gate) * up)                      gate_up = h @ gate_up^T [T, 2I]; act = spec.activation
                 (down(act(up)) where not spec.gated_mlp)
                 or, in a MoE layer (spec.is_moe(i)), the router's top-k experts' SwiGLU (Lowering.moe)
                 (+ the dense MLP where spec.shared_mlp: Granite 4.0-H; gated per token where
                 spec.shared_mlp_gate: Qwen3.5-MoE)
        x      = x + m                                     (sandwich_norm: m = rmsnorm(m) first)
        (Granite: a and m x spec.residual_scale before their adds)
        a layer without a mixer (kind "none") skips input_norm..x + a; one without an MLP (mlp type "none")
        skips post_norm..m, and its a is the add pending for the next norm (Nemotron-H's one-mixer blocks)
    last   = x[b*S + seq_lengths[b] - 1]                   [B, hidden]   (only the last valid token)
    logits = rmsnorm(last) @ lm_head^T                     [B, V] float32 (final_softcap: cap*tanh(l/cap);
                                                           Granite: / spec.logits_scaling)
    next_token = argmax(logits)

The ``verify`` graph (speculative decoding) is the same body over k+1 tokens of a row that already
has a cache; its head runs on every position instead of the last one only:
    seq_logits  = rmsnorm(x) @ lm_head^T                   [B, S, V] float32
    next_tokens = argmax(seq_logits)                       [B, S]  (next_tokens[b, j] follows token j)
It is a separate graph so that prefill keeps its one-token head (a head over a whole prompt would
cost a [S, V] GEMM per prompt); it reads the same weights.bin.

Where the verify graph needs an attention of its own to take several rows over caches (ort:
GroupQueryAttention takes several tokens over a cache only in a one-row call), the prefill graph
also serves one-row verify passes, with its own attention (cheaper there) and no second session
holding the weights: an input ``per_position`` [1] (0 by default: an initializer of that name)
adds every position's rows to the head's gather when 1, in the same lm_head GEMM:
    seq_logits  [B, S*per_position, V],  next_tokens [B, S*per_position]
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from decodert.errors import DecodertError
from decodert.artifact.lora_layout import LoraLayout
from decodert.export.lowering.delta_net import delta_net_mixer
from decodert.export.lowering.mamba2 import mamba2_mixer
from decodert.export.lowering.lora_graph import LoraGraph
from decodert.export.lowering import per_layer
from decodert.export.lowering.io_contract import GraphKind, io_contract, verifies_rows
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.models.spec import ModelSpec, rope_table_of, state_specs, window_layers


def build_graph(spec: ModelSpec, lowering: Lowering, weights: dict[str, onnx.TensorProto],
                kind: GraphKind, lora: LoraLayout | None = None) -> onnx.ModelProto:
    """The prefill or decode graph; ``weights`` maps canonical names (+ rope caches) to tensors;
    ``lora``: the adapter slots every linear layer takes (export/lowering/lora_graph.py)."""
    per_position = verifies_rows(lowering, kind)
    lowering = lowering.for_graph(kind)
    g = GraphBuilder(f"decodert_{spec.family}_{kind}", lowering.opsets)
    contract = io_contract(spec, lowering.dtype, lowering.max_seq, kind, per_position, lowering.kv, lora)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for t in weights.values():
        g.add_initializer(t)
    if per_position:  # the input's default: a plain prefill/decode call does not bind it
        g.add_initializer(numpy_helper.from_array(np.zeros(1, np.int64), "per_position"))
    images = any(io["name"] == "image_embeds" for io in contract["inputs"])
    if images:  # defaults: a text-only prefill (and every decode step the prefill graph serves) binds neither
        g.add_initializer(numpy_helper.from_array(np.zeros((0, spec.hidden_size), NUMPY_DTYPES[lowering.dtype]),
                                                  "image_embeds"))
        g.add_initializer(numpy_helper.from_array(np.zeros(0, np.int64), "image_positions"))
        if spec.deepstack_layers:
            g.add_initializer(numpy_helper.from_array(
                np.zeros((spec.deepstack_layers, 0, spec.hidden_size), NUMPY_DTYPES[lowering.dtype]), "deepstack_embeds"))
    if spec.mrope_section:  # text positions by default: offsets 0 on every axis
        g.add_initializer(numpy_helper.from_array(np.zeros((3, 1, 1), np.int64), "rope_offsets"))
    inp = GraphInputs("input_ids", "past_lengths", "seq_lengths", "rope.cos", "rope.sin",
                      windows=kind == "verify" and bool(window_layers(spec)))
    if images and spec.bidirectional_images:
        g.add_initializer(numpy_helper.from_array(np.zeros(0, np.int64), "image_ahead"))
        inp = dataclasses.replace(inp, ahead=_image_ahead(g, inp.input_ids))
    if kind == "verify" and state_specs(spec):  # no padding in a verify row of a hybrid: every position counts
        shape = g.op("Shape", inp.input_ids)
        g.op("Expand", g.op("Slice", shape, g.const([1]), g.const([2])), g.op("Slice", shape, g.const([0]), g.const([1])),
             outputs=["seq_lengths"])
    with g.scope("model"):
        contexts = _attention_contexts(g, lowering, inp, spec)
        readers = per_layer.read_contexts(g, lowering, inp, spec)
        adapters = None if lora is None else LoraGraph(g, lora, spec, lowering.dtype, inp.input_ids, lowering.flat_tokens)
        with g.scope("embed"):
            x = lowering.embed(g, inp.input_ids)
            if spec.embed_scale is not None:  # transformers rounds the factor to the weights' dtype
                x = g.op("Mul", x, g.const(np.array(spec.embed_scale, NUMPY_DTYPES[lowering.dtype])))
            if images:
                x = _place_images(g, spec, x)
            ple = per_layer.per_layer_inputs(g, lowering, spec, inp.input_ids, x) if spec.per_layer_input_size else None
        h = None
        for i in range(spec.num_layers):
            with g.scope(f"layers.{i}"):
                key = spec.layer_window(i), rope_table_of(spec, i)
                ctx = contexts[key] if spec.kv_source(i) == i else readers[key]
                x, h = _layer(g, lowering.for_layer(i), ctx, inp, spec, i, x, h, kind == "decode", adapters)
                if images and i < spec.deepstack_layers:
                    h = _add_deepstack(g, spec, h, i)
                x, h = per_layer.layer_end(g, lowering, spec, i, x, h, ple)
        if kind == "verify":
            heads = [_verify_head(g, lowering, inp, spec, x, h)]
        else:
            heads = list(_head(g, lowering, inp, spec, x, h, "per_position" if per_position else None))
    values = [v for logits in heads for v in (logits, g.op("ArgMax", logits, axis=-1, keepdims=0))]
    for io, value in zip(contract["outputs"], values):
        g.output(value, io["name"], io["dtype"], io["shape"])
    for io in contract["outputs"][len(values):]:
        g.outputs.append(onnx.helper.make_tensor_value_info(io["name"], DTYPES[io["dtype"]], io["shape"]))
    return g.to_model(ir_version=lowering.ir_version)


def _place_images(g: GraphBuilder, spec: ModelSpec, x: str) -> str:
    """The rows of the image tokens replaced by the image embeddings (scatter by position)."""
    with g.scope("images"):
        rows = g.op("Reshape", x, g.const([-1, spec.hidden_size]))  # [T, hidden]
        rows = g.op("ScatterND", rows, g.op("Unsqueeze", "image_positions", g.const([1])), "image_embeds")
        return g.op("Reshape", rows, g.op("Shape", x))


def _add_deepstack(g: GraphBuilder, spec: ModelSpec, mlp: str, i: int) -> str:
    """Qwen3-VL: the image rows of layer i's output gain deepstack_embeds[i] (added to the MLP output, which the
    next residual add sums with the stream)."""
    with g.scope("deepstack"):
        rows = g.op("Reshape", mlp, g.const([-1, spec.hidden_size]))
        extra = g.op("Gather", "deepstack_embeds", g.const(np.int64(i)), axis=0)  # [N, hidden]
        added = g.op("Add", g.op("Gather", rows, "image_positions", axis=0), extra)  # (TensorRT: no ScatterND add)
        rows = g.op("ScatterND", rows, g.op("Unsqueeze", "image_positions", g.const([1])), added)
        return g.op("Reshape", rows, g.op("Shape", mlp))
def _image_ahead(g: GraphBuilder, ids: str) -> str:
    """ahead [B,S] int64: image_ahead at image_positions (flat b*S + s), 0 elsewhere."""
    with g.scope("image_ahead"):
        shape = g.op("Shape", ids)
        flat = g.op("ConstantOfShape", g.op("ReduceProd", shape, keepdims=1), value=numpy_helper.from_array(
            np.zeros(1, np.int64)))
        flat = g.op("ScatterND", flat, g.op("Unsqueeze", "image_positions", g.const([1])), "image_ahead")
        return g.op("Reshape", flat, shape)


def _attention_contexts(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec) -> dict:
    """(window, rope table) -> the lowering's per-graph attention values, one per kind of layer.

    Llama: one kind; Gemma: sliding layers (window, local RoPE) and full layers (global RoPE).
    """
    contexts: dict = {}
    for i in range(spec.num_layers):
        key = (spec.layer_window(i), rope_table_of(spec, i))
        if key not in contexts and spec.kv_source(i) == i:
            table = dataclasses.replace(inp, cos_cache=f"{key[1]}.cos", sin_cache=f"{key[1]}.sin")
            contexts[key] = low.for_layer(i).context(g, table, key[0] or 0)
    return contexts


def _layer(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int,
           x: str, prev_mlp: str | None, one_token_rows: bool,
           lora: LoraGraph | None = None) -> tuple[str, str]:
    """One decoder layer. Returns (residual stream before the MLP add, MLP output)."""
    p = f"layers.{i}."

    def linear(h: str, target: str, bias: str | None = None) -> str:  # + each row's LoRA update
        y = low.linear(g, h, p + target, bias)
        return y if lora is None else lora.add(h, y, i, target)

    pending = prev_mlp  # the output not yet added to the residual stream
    if spec.has_mixer(i):
        with g.scope("input_norm"):
            h, x = _norm(g, low, pending, x, p + "input_norm")
        mixer = MIXERS.get(spec.layer_kind(i)) if spec.kv_source(i) == i else per_layer.shared_attention
        if mixer is None:
            raise DecodertError(f"layer {i}: decodert has no lowering for layer kind '{spec.layer_kind(i)}'")
        pending = mixer(g, low, ctx, inp, spec, i, h, linear)
        if spec.sandwich_norm:
            with g.scope("attn_out_norm"):
                pending = low.rms_norm(g, pending, p + "attn_out_norm")
        pending = _residual_scale(g, low, spec, pending)
    if not spec.has_mlp(i):
        assert pending is not None
        return x, pending
    with g.scope("post_norm"):
        h, x = _norm(g, low, pending, x, p + "post_norm")
    with g.scope("moe" if spec.is_moe(i) else "mlp"):
        down = low.moe(g, h, p, one_token_rows) if spec.is_moe(i) else _mlp(g, low, spec, i, h, linear)
        if spec.is_moe(i) and spec.shared_mlp:
            with g.scope("shared"):
                shared = _mlp(g, low, spec, i, h, linear)
                if spec.shared_mlp_gate:  # Qwen3.5-MoE: x sigmoid(h @ shared_gate^T), [.., 1] per token
                    shared = g.op("Mul", shared, g.op("Sigmoid", linear(h, "shared_gate")))
                down = g.op("Add", down, shared)
    if spec.sandwich_norm:
        with g.scope("mlp_out_norm"):
            down = low.rms_norm(g, down, p + "mlp_out_norm")
    return x, _residual_scale(g, low, spec, down)


def _residual_scale(g: GraphBuilder, low: Lowering, spec: ModelSpec, y: str) -> str:
    """y x spec.residual_scale (Granite's residual_multiplier, in the graph dtype); y itself when it is 1."""
    if spec.residual_scale == 1.0:
        return y
    return g.op("Mul", y, g.const(np.array(spec.residual_scale, NUMPY_DTYPES[low.dtype])))


def _norm(g: GraphBuilder, low: Lowering, pending: str | None, x: str, weight: str) -> tuple[str, str]:
    """(rmsnorm(x + pending), x + pending); just rmsnorm(x) with nothing pending (the first layer)."""
    if pending is None:
        return low.rms_norm(g, x, weight), x
    return low.add_rms_norm(g, pending, x, weight)


def _attention_mixer(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
                     linear: Callable[..., str]) -> str:
    """GQA over the layer's K/V cache -> the o projection's output; ``linear(x, target, bias)``: the layer's
    linears (with each row's LoRA update)."""
    p = f"layers.{i}."
    d = spec.head_dim_of(i)
    width, qd = (spec.num_heads + 2 * spec.num_kv_heads) * d, spec.num_heads * d
    with g.scope("attn"):
        with g.scope("qkv"):
            qkv = linear(h, "qkv", p + "qkv_bias" if spec.qkv_bias else None)
        if spec.attn_output_gate:  # rows q | gate | k | v
            q, gate, kv = g.op("Split", qkv, g.const([qd, qd, width - qd]), axis=-1, outputs=3)
            qkv = g.op("Concat", q, kv, axis=-1)
        if spec.qk_norm:
            with g.scope("qk_norm"):
                qkv = _qk_norm(g, low, spec, qkv, p)
        if low.flat_tokens:  # [T, qkv] -> [B, S, qkv]
            qkv = g.op("Reshape", qkv, g.op("Concat", g.op("Shape", inp.input_ids), g.const([width]), axis=0))
        cache = (f"past_key.{i}", f"past_value.{i}", f"present_key.{i}", f"present_value.{i}")
        attn = low.attention(g, ctx, qkv, cache, p + "sinks" if spec.attn_sinks else None)  # [B, S, H*D]
        if low.flat_tokens:
            attn = g.op("Reshape", attn, g.const([-1, qd]))
        if spec.attn_output_gate:
            attn = g.op("Mul", attn, g.op("Sigmoid", gate))
        with g.scope("o"):
            o = linear(attn, "o", p + "o_bias" if spec.o_bias else None)
    return o


def _conv_mixer(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
                linear: Callable[..., str]) -> str:
    """LFM2's gated short convolution over the layer's rolling conv state:
        b, c, x = split(h @ conv_in^T)             [.., C] each
        y       = c * causal_conv(b * x)           depthwise, K taps, state = the last K-1 inputs [B, C, K-1]
        o       = y @ conv_out^T
    """
    p, c = f"layers.{i}.", spec.hidden_size
    bias = spec.conv_bias
    with g.scope("conv"):
        with g.scope("in"):
            bcx = low.linear(g, h, p + "conv_in", p + "conv_in_bias" if bias else None)
        gate_b, gate_c, x = g.op("Split", bcx, g.const([c] * 3), axis=-1, outputs=3)
        bx = g.op("Mul", gate_b, x)
        bsc = g.op("Concat", g.op("Shape", inp.input_ids), g.const([c]), axis=0)  # [B, S, C]
        bcs = g.op("Transpose", g.op("Reshape", bx, bsc), perm=[0, 2, 1])  # [B, C, S]
        state = (f"past_conv.{i}", f"present_conv.{i}")
        y = low.causal_conv(g, bcs, p + "conv", p + "conv_bias" if bias else None, state, inp.seq_lengths,
                            window=f"window_conv.{i}" if inp.windows else None)
        y = g.op("Transpose", y, perm=[0, 2, 1])  # [B, S, C]
        y = g.op("Mul", gate_c, g.op("Reshape", y, g.const([-1, c])) if low.flat_tokens else y)
        with g.scope("out"):
            return low.linear(g, y, p + "conv_out", p + "conv_out_bias" if bias else None)


# layer kind (models/spec.py LAYER_KINDS) -> its token mixer: (g, lowering, attention context, inputs,
# spec, layer, normed input) -> output before the residual add; it writes the layer's cache or states
MIXERS = {"attention": _attention_mixer, "conv": _conv_mixer, "linear_attention": delta_net_mixer,
          "mamba2": mamba2_mixer}


def _mlp(g: GraphBuilder, low: Lowering, spec: ModelSpec, i: int, h: str, linear: Callable[[str, str], str]) -> str:
    """down(act(gate) * up), gate and up from one fused GEMM (down(act(up)) where not spec.gated_mlp);
    ``linear(x, target)``: layer ``i``'s linears."""
    if not spec.gated_mlp:
        with g.scope("up"):
            act = low.activation(g, linear(h, "up"))
        with g.scope("down"):
            return linear(act, "down")
    with g.scope("gate_up"):
        gate, up = g.op("Split", linear(h, "gate_up"), g.const([spec.mlp_size(i)] * 2), axis=-1, outputs=2)
    act = g.op("Mul", low.activation(g, gate), up)  # act(gate) * up
    with g.scope("down"):
        return linear(act, "down")


def _qk_norm(g: GraphBuilder, low: Lowering, spec: ModelSpec, qkv: str, p: str) -> str:
    """Qwen3: RMSNorm over head_dim on every q and k head (v untouched). qkv [T or B,S, (H+2Hkv)*D]."""
    d, h, hkv = low.head_dim, spec.num_heads, spec.num_kv_heads
    lead = [0] if low.flat_tokens else [0, 0]  # Reshape's 0 keeps the leading dims
    q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=-1, outputs=3)
    q = g.op("Reshape", low.rms_norm(g, g.op("Reshape", q, g.const(lead + [h, d])), p + "q_norm"), g.const(lead + [h * d]))
    k = g.op("Reshape", low.rms_norm(g, g.op("Reshape", k, g.const(lead + [hkv, d])), p + "k_norm"),
             g.const(lead + [hkv * d]))
    if spec.v_norm:  # Gemma 4: RMSNorm without a weight on v
        ones = g.const(np.ones(d, NUMPY_DTYPES[low.dtype]))
        v = g.op("Reshape", low.rms_norm(g, g.op("Reshape", v, g.const(lead + [hkv, d])), ones), g.const(lead + [hkv * d]))
    return g.op("Concat", q, k, v, axis=-1)


def _head(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec, x: str, mlp: str,
          per_position: str | None) -> tuple[str, ...]:
    """Residual add, gather the last valid token of each row, final norm, lm_head -> fp32 logits
    [B, V]; with ``per_position`` (an input [1]: 0 or 1) also every position's [B, S*p, V], their
    rows appended to the same gather and GEMM."""
    with g.scope("last_token"):
        shape = g.op("Shape", inp.input_ids)
        batch = g.op("Gather", shape, g.const(np.int64(0)), axis=0)
        seq = g.op("Gather", shape, g.const(np.int64(1)), axis=0)
        rows = g.op("Mul", g.op("Range", g.const(np.int64(0)), batch, g.const(np.int64(1))), seq)
        idx = g.op("Sub", g.op("Add", rows, inp.seq_lengths), g.const(np.int64(1)))  # [B]
        if per_position is not None:
            on = g.op("Gather", per_position, g.const(np.int64(0)), axis=0)  # 0 | 1
            every = g.op("Range", g.const(np.int64(0)), g.op("Mul", g.op("Mul", batch, seq), on), g.const(np.int64(1)))
            idx = g.op("Concat", idx, every, axis=0)  # [B + B*S*p]
        x, mlp = low.tokens(g, x, spec.hidden_size), low.tokens(g, mlp, spec.hidden_size)
        x_last, mlp_last = g.op("Gather", x, idx, axis=0), g.op("Gather", mlp, idx, axis=0)
    logits = _final_norm_head(g, low, spec, x_last, mlp_last)
    if per_position is None:
        return (logits,)
    with g.scope("per_position"):
        b1 = g.op("Unsqueeze", batch, g.const([0]))
        last = g.op("Slice", logits, g.const([0]), b1, g.const([0]))
        every = g.op("Slice", logits, b1, g.const([np.iinfo(np.int64).max]), g.const([0]))
        positions = g.op("Unsqueeze", g.op("Mul", seq, on), g.const([0]))
        every = g.op("Reshape", every, g.op("Concat", b1, positions, g.const([spec.vocab_size]), axis=0), allowzero=1)
    return last, every


def _verify_head(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec, x: str, mlp: str) -> str:
    """Residual add, final norm and lm_head on every token -> fp32 logits [B, S, V]."""
    x, mlp = low.tokens(g, x, spec.hidden_size), low.tokens(g, mlp, spec.hidden_size)  # [T, hidden]
    logits = _final_norm_head(g, low, spec, x, mlp)  # [T, V]
    with g.scope("per_position"):
        return g.op("Reshape", logits, g.op("Concat", g.op("Shape", inp.input_ids), g.const([spec.vocab_size]), axis=0))


def _final_norm_head(g: GraphBuilder, low: Lowering, spec: ModelSpec, x: str, mlp: str) -> str:
    """rmsnorm(x + mlp) @ lm_head^T over rows [N, hidden] -> fp32 logits [N, V]."""
    with g.scope("final_norm"):
        h, _ = low.add_rms_norm(g, mlp, x, "final_norm")
    with g.scope("lm_head"):
        tied = spec.tie_word_embeddings and "lm_head" not in low.quantized  # a quantized copy when tied
        logits = low.linear(g, h, "embed" if tied else "lm_head")
    logits = logits if low.dtype == "fp32" else g.op("Cast", logits, to=1)
    if spec.logits_scaling != 1.0:
        logits = g.op("Div", logits, g.const(np.float32(spec.logits_scaling)))
    if spec.final_softcap is not None:
        with g.scope("final_softcap"):
            logits = softcap(g, logits, spec.final_softcap)
    return logits


def softcap(g: GraphBuilder, x: str, cap: float) -> str:
    """cap * tanh(x / cap), float32 x."""
    return g.op("Mul", g.op("Tanh", g.op("Div", x, g.const(np.float32(cap)))), g.const(np.float32(cap)))

