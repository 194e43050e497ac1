"""One transformer graph recipe, parameterised by ModelSpec and a target Lowering.

    input_ids [B,S] --Gather(embed)--> x [T=B*S, hidden]   ([B,S,hidden] where lowering.flat_tokens is False)
                          x * embed_scale                  (Gemma: sqrt(hidden) in the graph dtype)
    M-RoPE (spec.mrope, Qwen-VL): input rope_offsets [3,B,S] turns every layer's RoPE by 3-D positions
                                                           (plugins/ops/mrope.py; default zeros = 1-D positions)
    prefill of a vision-language model (spec.images):
        x[image_positions] = image_embeds                  ScatterND over the [B*S, hidden] rows; image_positions
                                                           [N] = b*S + s of each image token, image_embeds [N, hidden]
                                                           (vision.onnx's output rows); both default to empty
        Qwen3-VL (spec.images.deepstack_layers = n): after layer i < n, x[image_positions] += deepstack_embeds[i]
        ahead[image_positions] = image_ahead               spec.images.bidirectional (Gemma 3): [N] how many later
                                                           tokens of its own image each image token also sees;
                                                           ahead [B,S] (0 elsewhere) widens the causal mask:
                                                           key j visible to query i iff j <= pos_i + ahead_i
    per layer i (spec.layers[i]: a mixer and an MLP of their kinds, each lowered by export/lowering/layers/__init__.py's table):
        h      = rmsnorm(x)                                (fused with the residual add below)
        a      = mixer(h)                                  attention (export/lowering/layers/attention.py: qkv, q/k norm,
                                                           CachedAttention over past/present.i in place, o), short
                                                           conv, Gated DeltaNet or Mamba2 over the layer's states
                                                           (sandwich_norm: a = rmsnorm(a))
        x, h   = x + a,  rmsnorm(x + a)
        m      = mlp(h)                                    dense (down(act(gate) * up), export/lowering/layers/mlp.py) or
                                                           the router's top-k experts (export/lowering/layers/moe.py)
        x      = x + m                                     (sandwich_norm: m = rmsnorm(m) first)
        (Granite: a and m x spec.residual_scale before their adds; Gemma 4: export/lowering/per_layer.py after)
        a layer without a mixer skips input_norm..x + a; one without an MLP skips post_norm..m, and its a is the
        add pending for the next norm (Nemotron-H's one-mixer blocks)
    last   = x[b*S + seq_lengths[b] - 1]                   [B, hidden]   (only the last valid token)
    logits = rmsnorm(last) @ lm_head^T                     [B, V] float32 (final_softcap: cap*tanh(l/cap);
                                                           Granite: / spec.logits_scaling)
    next_token = argmax(logits)

The ``verify`` graph (speculative decoding) is the same body over k+1 tokens of a row that already
has a cache; its head runs on every position instead of the last one only:
    seq_logits  = rmsnorm(x) @ lm_head^T                   [B, S, V] float32
    next_tokens = argmax(seq_logits)                       [B, S]  (next_tokens[b, j] follows token j)
With ``hidden`` (exported for a draft head: ``decodert export --hidden-states``, implied by a head's export) the
graphs also return the final norm's output, the state lm_head reads, bound in place like the logits:
    hidden_state [B, hidden] (prefill/decode: each row's last valid token), seq_hidden [B, S, hidden] (verify;
    the prefill graph that verifies rows: [B, S*per_position, hidden])
Without it nothing changes (no node, no output).
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

import numpy as np
import onnx
from onnx import numpy_helper

from decodert.errors import DecodertError
from decodert.artifact.lora_layout import LoraLayout
from decodert.export.lowering import per_layer
from decodert.export.lowering.layers import attention
from decodert.export.lowering.layers import MIXERS, MLPS
from decodert.export.lowering.lora_graph import LoraGraph
from decodert.export.lowering.io_contract import GraphKind, hidden_outputs, io_contract, verifies_rows
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.models.spec import ModelSpec, state_specs, window_layers


def build_graph(spec: ModelSpec, lowering: Lowering, weights: dict[str, onnx.TensorProto],
                kind: GraphKind, lora: LoraLayout | None = None, hidden: bool = False,
                hidden_layers: tuple[int, ...] = ()) -> onnx.ModelProto:
    """The prefill or decode graph; ``weights`` maps canonical names (+ rope caches) to tensors;
    ``lora``: the adapter slots every linear layer takes (export/lowering/lora_graph.py); ``hidden``: the
    graph also returns the last hidden state (io_contract.hidden_outputs: what a draft head reads);
    ``hidden_layers`` (with ``hidden``): those outputs carry the inputs of these layers instead, concatenated
    (an EAGLE-3 head's features)."""
    per_position = verifies_rows(lowering, kind)
    lowering = lowering.for_graph(kind)
    g = GraphBuilder(f"decodert_{spec.family}_{kind}", lowering.opsets)
    contract = io_contract(spec, lowering.dtype, lowering.max_seq, kind, per_position, lowering.kv, lora, hidden,
                           hidden_layers)
    hidden_ios = contract["outputs"][len(contract["outputs"]) - len(hidden_outputs(spec, lowering.dtype, kind,
                                                                                      per_position)):] if hidden else []
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for t in weights.values():
        g.add_initializer(t)
    if per_position:  # the input's default: a plain prefill/decode call does not bind it
        g.add_initializer(numpy_helper.from_array(np.zeros(1, np.int64), "per_position"))
    images = spec.images if any(io["name"] == "image_embeds" for io in contract["inputs"]) else None
    if images is not None:  # defaults: a text-only prefill (and every decode step the prefill graph serves) binds neither
        g.add_initializer(numpy_helper.from_array(np.zeros((0, spec.hidden_size), NUMPY_DTYPES[lowering.dtype]),
                                                  "image_embeds"))
        g.add_initializer(numpy_helper.from_array(np.zeros(0, np.int64), "image_positions"))
        if images.deepstack_layers:
            g.add_initializer(numpy_helper.from_array(
                np.zeros((images.deepstack_layers, 0, spec.hidden_size), NUMPY_DTYPES[lowering.dtype]), "deepstack_embeds"))
    if spec.mrope is not None:  # text positions by default: offsets 0 on every axis
        g.add_initializer(numpy_helper.from_array(np.zeros((3, 1, 1), np.int64), "rope_offsets"))
    inp = GraphInputs("input_ids", "past_lengths", "seq_lengths", "rope.cos", "rope.sin",
                      windows=kind == "verify" and bool(window_layers(spec)))
    if images is not None and images.bidirectional:
        g.add_initializer(numpy_helper.from_array(np.zeros(0, np.int64), "image_ahead"))
        inp = dataclasses.replace(inp, ahead=_image_ahead(g, inp.input_ids))
    if kind == "verify" and state_specs(spec):  # no padding in a verify row of a hybrid: every position counts
        shape = g.op("Shape", inp.input_ids)
        g.op("Expand", g.op("Slice", shape, g.const([1]), g.const([2])), g.op("Slice", shape, g.const([0]), g.const([1])),
             outputs=["seq_lengths"])
    with g.scope("model"):
        contexts = attention.contexts(g, lowering, inp, spec)
        adapters = None if lora is None else LoraGraph(g, lora, spec, lowering.dtype, inp.input_ids, lowering.flat_tokens)
        with g.scope("embed"):
            x = lowering.embed(g, inp.input_ids)
            if spec.embed_scale is not None:  # transformers rounds the factor to the weights' dtype
                x = g.op("Mul", x, g.const(np.array(spec.embed_scale, NUMPY_DTYPES[lowering.dtype])))
            if images is not None:
                x = _place_images(g, spec, x)
            ple = (per_layer.per_layer_inputs(g, lowering, spec, inp.input_ids, x, images is not None)
                   if spec.per_layer_inputs else None)
        h = None
        taken: dict[int, str] = {}  # hidden_layers: layer -> its input rows [T, hidden]
        for i in range(spec.num_layers):
            if hidden and i in hidden_layers:
                with g.scope(f"features.{i}"):
                    stream = x if h is None else g.op("Add", x, h)
                    taken[i] = lowering.tokens(g, stream, spec.hidden_size)
            with g.scope(f"layers.{i}"):
                ctx = attention.context_of(contexts, spec, i)
                x, h = decoder_layer(g, lowering.for_layer(i), ctx, inp, spec, i, x, h, kind == "decode", adapters)
                if images is not None and i < images.deepstack_layers:
                    h = _add_deepstack(g, spec, h, i)
                x, h = per_layer.layer_end(g, lowering, spec, i, x, h, ple)
        states: list[str] = []  # the hidden-state outputs' values, when asked for
        features = None if not taken else (g.op("Concat", *(taken[i] for i in hidden_layers), axis=-1),
                                           spec.hidden_size * len(hidden_layers))  # [T, n hidden]
        if kind == "verify":
            heads = [_verify_head(g, lowering, inp, spec, x, h, states if hidden else None, features)]
        else:
            heads = list(_head(g, lowering, inp, spec, x, h, "per_position" if per_position else None,
                               states if hidden else None, every_state=kind == "prefill", features=features))
    values = [v for logits in heads for v in (logits, g.op("ArgMax", logits, axis=-1, keepdims=0))]
    for io, value in zip(contract["outputs"], values):
        g.output(value, io["name"], io["dtype"], io["shape"])
    for io in contract["outputs"][len(values) : len(contract["outputs"]) - len(hidden_ios)]:
        g.outputs.append(onnx.helper.make_tensor_value_info(io["name"], DTYPES[io["dtype"]], io["shape"]))
    for io, value in zip(hidden_ios, states):
        g.output(value, io["name"], io["dtype"], io["shape"])
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


def decoder_layer(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int,
           x: str, prev_mlp: str | None, one_token_rows: bool,
           lora: LoraGraph | None = None) -> tuple[str, str]:
    """One decoder layer. Returns (residual stream before the MLP add, MLP output)."""
    p = f"layers.{i}."

    def linear(h: str, target: str, bias: str | None = None) -> str:  # + each row's LoRA update
        y = low.linear(g, h, p + target, bias)
        return y if lora is None else lora.add(h, y, i, target)

    pending = prev_mlp  # the output not yet added to the residual stream
    layer = spec.layers[i]
    if layer.mixer is not None:
        with g.scope("input_norm"):
            h, x = _norm(g, low, pending, x, p + "input_norm")
        mixer = MIXERS.get(layer.mixer_kind)
        if mixer is None:
            raise DecodertError(f"layer {i}: decodert has no lowering for layer kind '{layer.mixer_kind}'")
        pending = mixer(g, low, ctx, inp, spec, i, h, linear)
        if spec.sandwich_norm:
            with g.scope("attn_out_norm"):
                pending = low.rms_norm(g, pending, p + "attn_out_norm")
        pending = _residual_scale(g, low, spec, pending)
    if layer.mlp is None:
        assert pending is not None
        return x, pending
    with g.scope("post_norm"):
        h, x = _norm(g, low, pending, x, p + "post_norm")
    down = MLPS[layer.mlp_kind](g, low, spec, i, h, linear, one_token_rows)
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


def _head(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec, x: str, mlp: str,
          per_position: str | None, states: list[str] | None = None, every_state: bool = False,
          features: tuple[str, int] | None = None) -> tuple[str, ...]:
    """Residual add, gather the last valid token of each row, final norm, lm_head -> fp32 logits
    [B, V]; with ``per_position`` (an input [1]: 0 or 1) also every position's [B, S*p, V], their
    rows appended to the same gather and GEMM. ``states``: gets the final norm's output split the same
    way ([B, hidden], then [B, S*p, hidden]); with ``every_state`` (prefill) then every position's
    [B, S, hidden] too (the final norm on every row, no lm_head). ``features`` ([T, width], width): the rows
    ``states`` gets instead of the final norm's (hidden_layers' inputs)."""
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
    logits = _final_norm_head(g, low, spec, x_last, mlp_last, states if features is None else None)
    width = spec.hidden_size if features is None else features[1]
    if states is not None and features is not None:
        with g.scope("features"):
            states.append(g.op("Gather", features[0], idx, axis=0))  # [B (+ B*S*p), width]
    prompt = None
    if states is not None and every_state:
        with g.scope("prompt_hidden"):
            normed = low.add_rms_norm(g, mlp, x, "final_norm")[0] if features is None else features[0]  # [T, width]
            prompt = g.op("Reshape", normed, g.op("Concat", g.op("Unsqueeze", batch, g.const([0])),
                                                 g.op("Unsqueeze", seq, g.const([0])), g.const([width]),
                                                 axis=0))
    if per_position is None:
        if prompt is not None:
            states.append(prompt)
        return (logits,)
    with g.scope("per_position"):
        b1 = g.op("Unsqueeze", batch, g.const([0]))

        def split(rows: str, width: int) -> tuple[str, str]:  # (the op order keeps a graph without states as it was)
            last = g.op("Slice", rows, g.const([0]), b1, g.const([0]))
            every = g.op("Slice", rows, b1, g.const([np.iinfo(np.int64).max]), g.const([0]))
            positions = g.op("Unsqueeze", g.op("Mul", seq, on), g.const([0]))
            return last, g.op("Reshape", every, g.op("Concat", b1, positions, g.const([width]), axis=0), allowzero=1)

        last, every = split(logits, spec.vocab_size)
        if states:
            states[:] = [*split(states[0], width), *([prompt] if prompt is not None else [])]
    return last, every


def _verify_head(g: GraphBuilder, low: Lowering, inp: GraphInputs, spec: ModelSpec, x: str, mlp: str,
                 states: list[str] | None = None, features: tuple[str, int] | None = None) -> str:
    """Residual add, final norm and lm_head on every token -> fp32 logits [B, S, V] (``states``: gets the
    final norm's output [B, S, hidden]; with ``features`` ([T, width], width), those rows [B, S, width])."""
    x, mlp = low.tokens(g, x, spec.hidden_size), low.tokens(g, mlp, spec.hidden_size)  # [T, hidden]
    logits = _final_norm_head(g, low, spec, x, mlp, states if features is None else None)  # [T, V]
    if states is not None and features is not None:
        states.append(features[0])
    with g.scope("per_position"):
        shape = g.op("Shape", inp.input_ids)
        if states:
            width = spec.hidden_size if features is None else features[1]
            states[:] = [g.op("Reshape", states[0], g.op("Concat", shape, g.const([width]), axis=0))]
        return g.op("Reshape", logits, g.op("Concat", shape, g.const([spec.vocab_size]), axis=0))


def _final_norm_head(g: GraphBuilder, low: Lowering, spec: ModelSpec, x: str, mlp: str,
                     states: list[str] | None = None) -> str:
    """rmsnorm(x + mlp) @ lm_head^T over rows [N, hidden] -> fp32 logits [N, V]; ``states`` gets rmsnorm(x + mlp)."""
    with g.scope("final_norm"):
        h, _ = low.add_rms_norm(g, mlp, x, "final_norm")
    if states is not None:
        states.append(h)
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

