"""Gemma 4's assistant (multi-token prediction drafter): a few Gemma 4 text layers that draft the target's next
tokens from the target's last hidden state, the target's token embeddings and the target's own K/V.

    config.json  model_type gemma4_assistant: text_config (a gemma4_text config whose every layer reads another
                 layer's K/V), backbone_hidden_size (the target's hidden size), use_ordered_embeddings,
                 num_centroids, centroid_intermediate_top_k

One draft step (transformers' Gemma4AssistantForCausalLM with its candidate generator), for a row whose target
cache holds L positions, the token t after them not yet run and the target's hidden state h that chose t (the
final norm's output, io_contract.hidden_outputs):

    x      = pre_projection([embed_target(t) * sqrt(backbone), h])        [2 backbone] -> [hidden]
    layer  Gemma 4's block (sandwich norms, layer scalar, gelu-tanh MLP), attention scale 1, q norm, RoPE at
           position L; no K/V of its own: its queries attend over the target's cache of the last own-cache
           layer of the same kind (full: positions 0..L-1; sliding: the last window + 1 of them)
    h'     = post_projection(norm(x))                                     [backbone]  (the next step's h)
    logits = norm(x) @ embed^T                                            [V]  (tied; no soft-cap)
             use_ordered_embeddings: only the tokens of the top-k centroids get a score, the rest
             min(score) - 1 (the masked embedder)

Chained drafting keeps L (the position) and the target's cache and feeds back (its own token, h'). So the head
keeps no cache, nothing to rewind: it reads the target's rows as the cache owner (KVCache) has them.
"""

from __future__ import annotations

import dataclasses

from decodert.errors import DecodertError
from decodert.models.families import gemma3, gemma4
from decodert.models.rope import RopeSpec

MODEL_TYPES = ("gemma4_assistant",)

_L = "model.layers.{i}."
HF_WEIGHTS = {
    "embed": "model.embed_tokens.weight",  # tied lm_head
    "final_norm": "model.norm.weight",
    "pre_projection": "pre_projection.weight",
    "post_projection": "post_projection.weight",
    "centroids": "masked_embedding.centroids.weight",
    "token_ordering": "masked_embedding.token_ordering",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.attn_out_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.post_norm": _L + "pre_feedforward_layernorm.weight",
    "layers.{i}.mlp_out_norm": _L + "post_feedforward_layernorm.weight",
    "layers.{i}.q": _L + "self_attn.q_proj.weight",
    "layers.{i}.q_norm": _L + "self_attn.q_norm.weight",
    "layers.{i}.o": _L + "self_attn.o_proj.weight",
    "layers.{i}.gate": _L + "mlp.gate_proj.weight",
    "layers.{i}.up": _L + "mlp.up_proj.weight",
    "layers.{i}.down": _L + "mlp.down_proj.weight",
    "layers.{i}.layer_scalar": _L + "layer_scalar",
}


@dataclasses.dataclass(frozen=True)
class AssistantSpec:
    """What the head's graph needs (export/heads/gemma4_assistant.py builds it)."""

    hidden_size: int
    backbone_hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float
    window: int  # the sliding layers' window (transformers' bidirectional rule: distance <= window)
    kinds: tuple[str, ...]  # per layer: "full_attention" | "sliding_attention"
    head_dims: tuple[int, ...]  # per layer
    rope: RopeSpec  # full layers
    local_rope: RopeSpec  # sliding layers
    ordered: bool = False  # use_ordered_embeddings
    num_centroids: int = 0
    top_k: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.kinds)


def spec_from_hf(config: dict) -> AssistantSpec:
    """The head's spec from its config.json; what it cannot be (per-layer inputs, MoE, a layer with its own K/V) is
    refused in one line naming it."""
    text = config.get("text_config")
    if config.get("model_type") != "gemma4_assistant" or not isinstance(text, dict):
        raise DecodertError("a gemma4_assistant config.json needs model_type gemma4_assistant and a text_config object")
    text = {**gemma4.HF_DEFAULTS, **text}
    layers = int(text["num_hidden_layers"])
    shared = int(text.get("num_kv_shared_layers") or layers)  # transformers: 0 means all
    for key, what in (("hidden_size_per_layer_input", "per-layer inputs"), ("enable_moe_block", "the MoE block"),
                      ("use_double_wide_mlp", "double-wide MLPs"), ("attention_k_eq_v", "attention_k_eq_v")):
        if text.get(key):
            raise DecodertError(f"gemma4_assistant: {what} ({key}) is not supported")
    if shared != layers:
        raise DecodertError(f"gemma4_assistant: every layer must read the target's K/V (num_kv_shared_layers "
                            f"{shared} of {layers})")
    act = text.get("hidden_activation")
    if act not in gemma3.GELU_TANH:
        raise DecodertError(f"gemma4_assistant: hidden_activation '{act}' is not supported (only gelu_pytorch_tanh)")
    kinds = gemma4.layer_types(text)
    full, local = gemma4.ropes(text)
    ordered = bool(config.get("use_ordered_embeddings"))
    centroids = int(config.get("num_centroids", 2048)) if ordered else 0
    vocab = int(text["vocab_size"])
    if ordered and (centroids < 1 or vocab % centroids):
        raise DecodertError(f"gemma4_assistant: vocab_size {vocab} is not a multiple of num_centroids {centroids}")
    return AssistantSpec(
        hidden_size=int(text["hidden_size"]), backbone_hidden_size=int(config.get("backbone_hidden_size", 1536)),
        vocab_size=vocab, num_heads=int(text["num_attention_heads"]), num_kv_heads=int(text["num_key_value_heads"]),
        intermediate_size=int(text["intermediate_size"]), rms_norm_eps=float(text["rms_norm_eps"]),
        window=int(text.get("sliding_window") or 0), kinds=tuple(kinds), head_dims=gemma4.layer_head_dims(text, kinds),
        rope=full, local_rope=local, ordered=ordered, num_centroids=centroids,
        top_k=int(config.get("centroid_intermediate_top_k", 32)) if ordered else 0)


def weight_names(spec: AssistantSpec) -> dict[str, str]:
    """Canonical name -> checkpoint key of every tensor the head reads."""
    names = {}
    for canon, key in HF_WEIGHTS.items():
        if canon in ("centroids", "token_ordering") and not spec.ordered:
            continue
        if "{i}" in canon:
            names.update({canon.format(i=i): key.format(i=i) for i in range(spec.num_layers)})
        else:
            names[canon] = key
    return names


def source_layers(target_spec, spec: AssistantSpec) -> dict[str, int]:
    """Kind -> the target's layer whose cache the head's layers of that kind read: the last layer of the kind that
    keeps its own K/V (transformers' "store" layer). Refused in one line where the target has none, or its heads or
    widths differ."""
    own = [i for i in target_spec.kv_layers]
    out = {}
    for kind in sorted(set(spec.kinds)):
        layers = [i for i in own if target_spec.is_sliding(i) == (kind == "sliding_attention")]
        if not layers:
            raise DecodertError(f"gemma4_assistant: the target has no {kind} layer with its own K/V")
        out[kind] = layers[-1]
    for i, kind in enumerate(spec.kinds):
        src = out[kind]
        if target_spec.head_dim_of(src) != spec.head_dims[i] or target_spec.num_kv_heads != spec.num_kv_heads:
            raise DecodertError(f"gemma4_assistant: layer {i} ({kind}) has {spec.num_kv_heads} K/V heads of "
                                f"{spec.head_dims[i]} where the target's layer {src} has {target_spec.num_kv_heads} "
                                f"of {target_spec.head_dim_of(src)}")
    return out
