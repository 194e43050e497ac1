"""A graph's inputs and outputs, by name, dtype and shape: what export writes to the manifest and what
every backend binds (the graph recipe itself is export/lowering/graph.py; what the manifest promises of it,
artifact/graph_contract.py).

    input_ids [B,S], past_lengths [B], seq_lengths [B] (not in verify graphs: every position is an output)
    logits [B,V] + next_token [B]  (verify: seq_logits [B,S,V] + next_tokens [B,S])
    prefill of a vision-language model: image_embeds / image_positions (/ image_ahead, deepstack_embeds)
    M-RoPE models: rope_offsets [3,B,S];  the prefill graph serving one-row verifies: per_position [1]
    past_/present_key|value.{i} per K/V layer, past_/present_{conv,recurrent}.{i} per stateful layer,
    window_conv.{i} (verify graphs of conv layers), the LoRA slots' inputs
"""

from __future__ import annotations

from typing import Literal

from decodert.artifact.lora_layout import LoraLayout
from decodert.export.lowering.lowering import Lowering
from decodert.models.spec import ModelSpec, state_specs, window_layers
from decodert.plugins.ops.kv_dtypes import KV_DTYPES, KVDtype

GraphKind = Literal["prefill", "decode", "verify"]
# the inputs with a default initializer, and those a TensorRT engine keeps: artifact/graph_contract.py
VERIFY_WIDTH = 16  # tokens one verify call can check per row (draft length + 1), the TensorRT profile's seq max


def verifies_rows(lowering: Lowering, kind: GraphKind) -> bool:
    """Whether graph ``kind`` takes ``per_position`` (one-row verify passes): the prefill graph, where
    the verify graph is built with an attention of its own because the prefill/decode one cannot
    take several rows of several tokens over caches."""
    return kind == "prefill" and lowering.for_graph("verify").batched_past and not lowering.batched_past


def io_contract(spec: ModelSpec, dtype: str, max_seq: int, kind: GraphKind,
                per_position: bool = False, kv: KVDtype | None = None,
                lora: LoraLayout | None = None, hidden: bool = False,
                hidden_layers: tuple[int, ...] = ()) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of a graph's inputs and outputs (also written to the manifest);
    ``per_position``: the prefill graph's one-row verify input and outputs (``verifies_rows``);
    ``kv``: the cache's element type (default ``dtype``): its storage and packed width.
    ``lora``: the adapter slots' inputs (artifact/lora_layout.py). ``hidden``: also the last hidden state a draft
    head reads (``HIDDEN_OUTPUTS``), listed last; without it the contract is what it was before.
    ``hidden_layers``: those outputs carry the inputs of these layers, concatenated (an EAGLE-3 head's features)."""
    seq: int | str = 1 if kind == "decode" else "seq"
    kv = kv or KV_DTYPES[dtype]
    inputs: list[dict] = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", seq]},
        {"name": "past_lengths", "dtype": "int64", "shape": ["batch"]},
        {"name": "seq_lengths", "dtype": "int64", "shape": ["batch"]},
    ]
    if kind == "verify":  # every position is an output: no last valid token to pick
        inputs.pop()
    outputs: list[dict] = [
        {"name": "logits", "dtype": "fp32", "shape": ["batch", spec.vocab_size]},
        {"name": "next_token", "dtype": "int64", "shape": ["batch"]},
    ] if kind != "verify" else [
        {"name": "seq_logits", "dtype": "fp32", "shape": ["batch", "seq", spec.vocab_size]},
        {"name": "next_tokens", "dtype": "int64", "shape": ["batch", "seq"]},
    ]
    images = spec.images
    if kind == "prefill" and images is not None:
        inputs += [{"name": "image_embeds", "dtype": dtype, "shape": ["image_tokens", spec.hidden_size]},
                   {"name": "image_positions", "dtype": "int64", "shape": ["image_tokens"]}]
        if images.bidirectional:
            inputs.append({"name": "image_ahead", "dtype": "int64", "shape": ["image_tokens"]})
        if images.deepstack_layers:  # Qwen3-VL: the vision tower's earlier features, added after the first layers
            inputs.append({"name": "deepstack_embeds", "dtype": dtype,
                           "shape": [images.deepstack_layers, "image_tokens", spec.hidden_size]})
    if spec.mrope is not None:  # M-RoPE (plugins/ops/mrope.py): position - cache index on each axis t, h, w
        inputs.append({"name": "rope_offsets", "dtype": "int64", "shape": [3, "batch", seq]})
    if per_position:
        inputs.append({"name": "per_position", "dtype": "int64", "shape": [1]})
        outputs += [{"name": "seq_logits", "dtype": "fp32", "shape": ["batch", "positions", spec.vocab_size]},
                    {"name": "next_tokens", "dtype": "int64", "shape": ["batch", "positions"]}]
    for i in spec.kv_layers:
        cache_shape = ["batch", spec.num_kv_heads, max_seq, kv.width(spec.head_dim_of(i))]
        for name in ("key", "value"):
            inputs.append({"name": f"past_{name}.{i}", "dtype": kv.storage, "shape": cache_shape})
            outputs.append({"name": f"present_{name}.{i}", "dtype": kv.storage, "shape": cache_shape})
    if kind == "verify":  # the conv inputs of every position (speculation takes the state after j from them)
        for i in window_layers(spec):
            outputs.append({"name": f"window_conv.{i}", "dtype": dtype, "shape": ["batch", spec.hidden_size, "window"]})
    for st in state_specs(spec):  # hybrid models: conv / recurrent states, bound in place like K/V
        inputs.append({"name": f"past_{st.io_name}", "dtype": st.dtype or dtype, "shape": ["batch", *st.shape]})
        outputs.append({"name": f"present_{st.io_name}", "dtype": st.dtype or dtype, "shape": ["batch", *st.shape]})
    if lora is not None:
        inputs += lora.inputs(spec, dtype)
    if hidden:
        outputs += hidden_outputs(spec, dtype, kind, per_position, hidden_layers)
    return {"inputs": inputs, "outputs": outputs}


# the target's last hidden state (after the final norm, what lm_head reads) that a draft head takes
HIDDEN_OUTPUTS = ("hidden_state", "seq_hidden")


def hidden_outputs(spec: ModelSpec, dtype: str, kind: GraphKind, per_position: bool = False,
                   hidden_layers: tuple[int, ...] = ()) -> list[dict]:
    """The hidden-state outputs of graph ``kind``, in the order the graph emits them: prefill/decode
    ``hidden_state`` [B, W] (each row's last valid token; the prefill graph that verifies rows also
    ``seq_hidden`` [B, positions, W]; every prefill graph then ``prompt_hidden`` [B, S, W]: every
    position's, whatever per_position says); verify ``seq_hidden`` [B, S, W]. W is hidden, the final norm's
    output; with ``hidden_layers`` (the manifest's ``hidden_layers``, ``--hidden-states eagle3``) the inputs of
    those layers concatenated in that order, W = len(hidden_layers) x hidden."""
    w = spec.hidden_size * (len(hidden_layers) or 1)
    if kind == "verify":
        return [{"name": "seq_hidden", "dtype": dtype, "shape": ["batch", "seq", w]}]
    out = [{"name": "hidden_state", "dtype": dtype, "shape": ["batch", w]}]
    if per_position:
        out.append({"name": "seq_hidden", "dtype": dtype, "shape": ["batch", "positions", w]})
    if kind == "prefill":  # every prompt position's (an MTP head's own K/V covers the prompt)
        out.append({"name": "prompt_hidden", "dtype": dtype, "shape": ["batch", "seq", w]})
    return out
