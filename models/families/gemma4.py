"""Gemma 4 text (the E2B/E4B layout): Gemma 3's block with plain-w RMSNorms, attention scale 1, a weightless
RMSNorm on v, per-layer input embeddings, K/V shared by the last layers, double-wide MLPs on those layers,
a scalar on each layer's output, proportional RoPE on the full layers and a final logit soft-cap.

    config.json  model_type gemma4_text, or gemma4 (an image/audio-text checkpoint: its text_config and
                 its language-model weights; the vision and audio towers are left out)

The full layers' head_dim (``global_head_dim``, 512 in the E2B/E4B) may differ from the sliding layers'
(``layer_head_dims``: each K/V layer's cache has its own last dimension). What decodert cannot run yet is
refused in one line naming it: ``attention_k_eq_v`` (and the per-layer K/V head count it brings), the MoE block
(``enable_moe_block``: the 26B-A4B's dense MLP + experts), bidirectional attention.
"""

from __future__ import annotations

import dataclasses

from typing import Any

from decodert.errors import DecodertError
from decodert.models.common import hf_attention, hf_layers, hf_mlp, hf_rope, positive_or_none, spec_from_hf_config
from decodert.models.families import gemma3
from decodert.models.layers import LayerSpec
from decodert.models.spec import ModelSpec, PerLayerInputs, RopeSpec

MODEL_TYPES = ("gemma4_text", "gemma4")

_L = "model.layers.{i}."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **{k: v for k, v in gemma3.HF_WEIGHTS.items()},
    "layers.{i}.q": _L + "self_attn.q_proj.weight",  # a layer that reads another layer's K/V
    "embed_per_layer": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm": "model.per_layer_projection_norm.weight",
    "layers.{i}.ple_gate": _L + "per_layer_input_gate.weight",
    "layers.{i}.ple_proj": _L + "per_layer_projection.weight",
    "layers.{i}.ple_norm": _L + "post_per_layer_input_norm.weight",
    "layers.{i}.layer_scalar": _L + "layer_scalar",
}

# transformers' Gemma4TextConfig defaults: a multimodal config.json lists only what differs.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, global_head_dim=512, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, sliding_window=512, final_logit_softcapping=None, vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256, attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
    use_double_wide_mlp=False,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}},
)
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def sanitize(key: str) -> str | None:
    """An image/audio-text checkpoint's language-model keys -> the text model's names; the towers dropped."""
    if key.startswith(_TOWERS):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def _text_config(config: dict) -> dict:
    if config.get("model_type") != "gemma4":
        return {**HF_DEFAULTS, **config}
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DecodertError("a gemma4 config.json needs a 'text_config' object")
    top = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
    return {**HF_DEFAULTS, **text, **top}


def layer_types(config: dict) -> list[str]:
    """transformers' rule: every 6th layer full unless listed; the last layer is always full."""
    layers = hf_layers(config)
    kinds = list(config.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)])
    if any(k not in ("sliding_attention", "full_attention") for k in kinds) or len(kinds) != layers:
        raise DecodertError(f"layer_types must list sliding_attention / full_attention for {layers} layers")
    kinds[-1] = "full_attention"
    return kinds


def kv_sources(kinds: list[str], shared: int) -> tuple[int, ...]:
    """Each layer's cache: its own, or for the last ``shared`` layers the last earlier own-cache layer of its
    kind (transformers' kv_sharing_modes: the "store" layer a "reuse" layer reads)."""
    first = len(kinds) - shared
    if shared <= 0:
        return ()
    if first <= 0 or set(kinds[first:]) - set(kinds[:first]):
        raise DecodertError(f"num_kv_shared_layers {shared}: every layer kind that shares K/V needs an earlier "
                            "layer of its kind that keeps a cache")
    last = {k: i for i, k in enumerate(kinds[:first])}
    return tuple(i if i < first else last[kinds[i]] for i in range(len(kinds)))


def layer_head_dims(config: dict, kinds: list[str]) -> tuple[int, ...]:
    """Each layer's head_dim: transformers' per_layer_config as saved (only what differs), else global_head_dim
    on the full layers. Another K/V head count on some layers (only with attention_k_eq_v) is refused."""
    head_dim, kv_heads = int(config["head_dim"]), int(config["num_key_value_heads"])
    per_layer = config.get("per_layer_config")
    dims = []
    for i, kind in enumerate(kinds):
        if isinstance(per_layer, dict):
            override = per_layer.get(str(i), per_layer.get(i)) or {}
        else:
            override = {"head_dim": config.get("global_head_dim")} if kind == "full_attention" else {}
        h = int(override.get("num_key_value_heads") or kv_heads)
        if h != kv_heads:
            raise DecodertError(f"layer {i} ({kind}) has {h} K/V heads where the others have {kv_heads}: "
                                "a per-layer K/V head count is not supported")
        dims.append(int(override.get("head_dim") or head_dim))
    return tuple(dims)


def ropes(config: dict) -> tuple[RopeSpec, RopeSpec]:
    """(full layers' RoPE, sliding layers' RoPE); "proportional" turns the first partial_rotary_factor of the
    angles over the whole head (transformers' _compute_proportional_rope_parameters)."""
    params = config.get("rope_parameters") or {}
    ropes = []
    for kind in ("full_attention", "sliding_attention"):
        p = dict(params.get(kind) or {})
        if p.get("rope_type") == "proportional":
            ropes.append(RopeSpec(theta=float(p.get("rope_theta", 10_000.0)), scaling="proportional",
                                  factor=float(p.get("factor", 1.0)),
                                  proportion=float(p.get("partial_rotary_factor", 1.0))))
        else:
            if p.get("partial_rotary_factor", 1.0) != 1.0:
                raise DecodertError(f"{kind}: partial_rotary_factor with rope_type {p.get('rope_type')!r} "
                                    "is not supported for gemma4")
            ropes.append(hf_rope({"rope_parameters": p}))
    return ropes[0], ropes[1]


def _refuse(config: dict) -> None:
    for key, what in (("enable_moe_block", "the MoE block (enable_moe_block)"),
                      ("attention_k_eq_v", "attention_k_eq_v (values from the key projection)"),
                      ("attention_bias", "attention_bias")):
        if config.get(key):
            raise DecodertError(f"gemma4: {what} is not supported")
    if config.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": only image tokens, none in text
        raise DecodertError(f"gemma4: use_bidirectional_attention {config['use_bidirectional_attention']!r} is not "
                            "supported (decodert is causal)")
    act = config.get("hidden_activation")
    if act not in gemma3.GELU_TANH:
        raise DecodertError(f"hidden_activation '{act}' is not supported for gemma4 (only gelu_pytorch_tanh)")


def spec_from_hf(config: dict) -> ModelSpec:
    config = _text_config(config)
    _refuse(config)
    kinds = layer_types(config)
    dims = layer_head_dims(config, kinds)
    full, local = ropes(config)
    sources = kv_sources(kinds, int(config.get("num_kv_shared_layers") or 0))
    double = bool(config.get("use_double_wide_mlp")) and bool(sources)
    per_layer = int(config.get("hidden_size_per_layer_input") or 0)
    window = config.get("sliding_window")
    if not window and "sliding_attention" in kinds:
        raise DecodertError("sliding layers need a sliding_window")
    attention = hf_attention(config, qk_norm=True, v_norm=True, scale=1.0)
    mlp = hf_mlp(config, activation="gelu_tanh")
    wide = dataclasses.replace(mlp, size=2 * mlp.size)

    def layer(i: int) -> LayerSpec:
        a = dataclasses.replace(attention, head_dim=dims[i], kv_source=sources[i] if sources and sources[i] != i else None)
        if kinds[i] != "full_attention":
            a = dataclasses.replace(a, window=int(window) if window else None, rope_table="rope_local")
        return LayerSpec(a, wide if double and sources[i] != i else mlp)

    return spec_from_hf_config(
        "gemma4", config, layer, check_activation=False, sandwich_norm=True,
        embed_scale=float(config["hidden_size"]) ** 0.5, rope=full, local_rope=local,
        final_softcap=positive_or_none(config.get("final_logit_softcapping")),
        per_layer_inputs=PerLayerInputs(per_layer, int(config.get("vocab_size_per_layer_input") or 0), "gelu_tanh")
        if per_layer else None,
        layer_scalar=True,
    )
