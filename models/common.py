"""Helpers shared by the family files: config/metadata fields -> ModelSpec pieces (core settings, the
attention and dense MLP most layers have, the layer count).

Family files stay declarative; anything two families read the same way lives here.
Errors carry no file name: ``open_checkpoint`` adds it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Union

import numpy as np

from decodert.errors import DecodertError
from decodert.models.layers import AttentionSpec, DenseMLPSpec, LayerSpec, MoESpec
from decodert.models.spec import MAX_LAYERS, ModelSpec, RopeSpec

# Config keys that mean "not a plain dense decoder" when set to a truthy value.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_GGUF_MOE_KEYS = ("expert_count", "expert_used_count")


def reject_unsupported_hf(config: dict, check_activation: bool = True, check_moe: bool = True) -> None:
    """Raise for configs decodert cannot run: MoE (unless the family reads its experts), non-SiLU MLP
    (unless the family reads its own activation), extra biases, encoder-decoder."""
    for key in _MOE_KEYS if check_moe else ():
        if config.get(key):
            raise DecodertError(f"mixture-of-experts models are not supported ({key}={config[key]})")
    if config.get("is_encoder_decoder"):
        raise DecodertError("encoder-decoder models are not supported (is_encoder_decoder=true)")
    act = config.get("hidden_act", "silu")
    if check_activation and act not in ("silu", "swish"):
        raise DecodertError(f"hidden_act '{act}' is not supported (only silu)")
    if config.get("mlp_bias"):
        raise DecodertError("mlp_bias=true is not supported")


def reject_unsupported_gguf(meta: dict, check_moe: bool = True) -> None:
    arch = meta.get("general.architecture", "?")
    for key in _GGUF_MOE_KEYS if check_moe else ():
        if meta.get(f"{arch}.{key}"):
            raise DecodertError(f"mixture-of-experts models are not supported ({arch}.{key})")


def hf_rope(config: dict) -> RopeSpec:
    """RopeSpec from `rope_scaling` (transformers 4.x) and/or `rope_parameters` (5.x)."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, scaling="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            scaling="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        )
    if kind == "yarn":
        return _yarn(rope, theta, config)
    raise DecodertError(f"rope scaling '{kind}' is not supported yet")


def _yarn(rope: dict, theta: float, config: dict) -> RopeSpec:
    """YaRN as transformers reads it: the attention factor from ``attention_factor``, else from
    ``mscale`` / ``mscale_all_dim``, else 0.1 ln(factor) + 1; ``truncate`` defaults to true."""
    original = int(rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 4096))
    factor = float(rope.get("factor") or int(config.get("max_position_embeddings", original)) / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeSpec(theta=theta, scaling="yarn", factor=factor, original_max_position=original,
                    beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                    truncate=bool(rope.get("truncate", True)), attention_factor=float(attention))


def partial_rotary_factor(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))


def eos_ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id` as found in configs: None, an int, or a list of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(dict.fromkeys(int(v) for v in value))
    return (int(value),)


def _req(source: dict, key: str, what: str) -> Any:
    if source.get(key) is None:
        raise DecodertError(f"{what} has no '{key}'")
    return source[key]


def layer_count(value: Any, what: str) -> int:
    """A declared layer count, checked before any per-layer list is built from it (the checkpoint's tensors
    bound it later, export/checkpoints/checkpoint.py ``build_spec``)."""
    n = int(value)
    if not 0 < n <= MAX_LAYERS:
        raise DecodertError(f"{what} {n} must be 1..{MAX_LAYERS} layers")
    return n


def declared(cls: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` (a kind spec), its refusal of the settings as a one-line DecodertError."""
    try:
        return cls(*args, **kwargs)
    except ValueError as e:
        raise DecodertError(str(e)) from None


def hf_layers(config: dict) -> int:
    return layer_count(_req(config, "num_hidden_layers", "config.json"), "num_hidden_layers")


def hf_attention(config: dict, **variants: Any) -> AttentionSpec:
    """The attention of config.json's heads and head_dim; ``variants``: the family's AttentionSpec settings."""
    hidden = int(_req(config, "hidden_size", "config.json"))
    heads = int(_req(config, "num_attention_heads", "config.json"))
    return declared(AttentionSpec, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
                    head_dim=int(config.get("head_dim") or hidden // heads), **variants)


def hf_mlp(config: dict, **settings: Any) -> DenseMLPSpec:
    """The dense MLP of config.json's intermediate_size; ``settings``: activation, gated."""
    return declared(DenseMLPSpec, int(_req(config, "intermediate_size", "config.json")), **settings)


Layers = Union[tuple[LayerSpec, ...], Callable[[int], LayerSpec], None]


Part = Union[AttentionSpec, DenseMLPSpec, MoESpec, Mapping[str, Any], None]


def spec_from_hf_config(family: str, config: dict, layers: Layers = None, *, attention: Part = None,
                        mlp: Part = None, check_activation: bool = True, check_moe: bool = True,
                        **core: Any) -> ModelSpec:
    """The core settings every family reads the same way from config.json, ``core`` overriding, and the layers:
    ``layers`` (a tuple, or layer index -> LayerSpec), else every layer ``attention`` then ``mlp`` (a spec, or the
    settings ``hf_attention`` / ``hf_mlp`` add to config.json's sizes). ``check_activation`` / ``check_moe``:
    refuse a non-SiLU hidden_act / MoE keys (a family that reads its own activation or experts turns them off)."""
    reject_unsupported_hf(config, check_activation=check_activation, check_moe=check_moe)
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=int(_req(config, "vocab_size", "config.json")),
        hidden_size=int(_req(config, "hidden_size", "config.json")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=hf_rope(config),
        max_position=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
    )
    fields.update(core)
    if layers is None:
        layer = LayerSpec(_part(attention, lambda **v: hf_attention(config, **v)), _part(mlp, lambda **v: hf_mlp(config, **v)))
        layers = (layer,) * hf_layers(config)
    elif callable(layers):
        layers = tuple(declared(layers, i) for i in range(hf_layers(config)))
    return _build({**fields, "layers": layers})


def gguf_key(meta: dict, key: str, default: Any = ...) -> Any:
    """`{arch}.{key}` from GGUF metadata; required unless a default is given."""
    arch = meta.get("general.architecture", "?")
    full = f"{arch}.{key}"
    if full in meta:
        return meta[full]
    if default is ...:
        raise DecodertError(f"GGUF metadata has no '{full}'")
    return default


def f32(value: Any) -> float:
    """A GGUF float32 as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def gguf_rope(meta: dict, head_dim: int) -> RopeSpec:
    """RopeSpec from GGUF metadata (llama3 frequency factors are handled by the loader)."""
    theta = f32(gguf_key(meta, "rope.freq_base", 10000.0))
    rot = int(gguf_key(meta, "rope.dimension_count", head_dim))
    rotary_dim = rot if rot != head_dim else None
    kind = gguf_key(meta, "rope.scaling.type", "none")
    if kind == "none":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim)
    if kind == "linear":
        factor = f32(gguf_key(meta, "rope.scaling.factor"))
        return RopeSpec(theta=theta, scaling="linear", factor=factor, rotary_dim=rotary_dim)
    raise DecodertError(f"rope scaling '{kind}' is not supported yet")


def gguf_layers(meta: dict) -> int:
    return layer_count(gguf_key(meta, "block_count"), "block_count")


def gguf_attention(meta: dict, **variants: Any) -> AttentionSpec:
    """The attention of the metadata's heads and key length; ``variants``: the family's AttentionSpec settings."""
    hidden = int(gguf_key(meta, "embedding_length"))
    heads = int(gguf_key(meta, "attention.head_count"))
    return declared(AttentionSpec, num_heads=heads, num_kv_heads=int(gguf_key(meta, "attention.head_count_kv", heads)),
                    head_dim=int(gguf_key(meta, "attention.key_length", hidden // heads)), **variants)


def gguf_mlp(meta: dict, **settings: Any) -> DenseMLPSpec:
    return declared(DenseMLPSpec, int(gguf_key(meta, "feed_forward_length")), **settings)


def spec_from_gguf_meta(family: str, meta: dict, layers: Layers = None, *, attention: Part = None,
                        mlp: Part = None, check_moe: bool = True, **core: Any) -> ModelSpec:
    """The core settings every family reads the same way from GGUF metadata, ``core`` overriding, and the layers
    as ``spec_from_hf_config`` takes them (the parts' defaults: ``gguf_attention``, ``gguf_mlp``)."""
    reject_unsupported_gguf(meta, check_moe=check_moe)
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=int(gguf_key(meta, "vocab_size")),
        hidden_size=int(gguf_key(meta, "embedding_length")),
        rms_norm_eps=f32(gguf_key(meta, "attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(gguf_key(meta, "context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids([e for e in eos if e is not None]),
    )
    if "rope" not in core:
        fields["rope"] = gguf_rope(meta, gguf_attention(meta).head_dim)
    fields.update(core)
    if layers is None:
        layer = LayerSpec(_part(attention, lambda **v: gguf_attention(meta, **v)), _part(mlp, lambda **v: gguf_mlp(meta, **v)))
        layers = (layer,) * gguf_layers(meta)
    elif callable(layers):
        layers = tuple(declared(layers, i) for i in range(gguf_layers(meta)))
    return _build({**fields, "layers": layers})


def replace_attention(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """``spec`` with ``changes`` to the settings of every attention layer (the other layers as they are)."""
    layers = tuple(dataclasses.replace(layer, mixer=dataclasses.replace(layer.mixer, **changes))
                   if isinstance(layer.mixer, AttentionSpec) else layer for layer in spec.layers)
    return dataclasses.replace(spec, layers=layers)


def _part(part: Part, make: Callable[..., Any]) -> Any:
    """A layer part as given, or made from the config with the given settings (none: the plain one)."""
    return part if part is not None and not isinstance(part, Mapping) else make(**(part or {}))


def _build(fields: dict[str, Any]) -> ModelSpec:
    if fields["bos_token_id"] is not None:
        fields["bos_token_id"] = int(fields["bos_token_id"])
    try:
        return ModelSpec(**fields)
    except ValueError as e:
        raise DecodertError(str(e)) from None


def positive_or_none(value: Any) -> float | None:
    """A setting that only matters when positive (a softcap): its float, or None for 0 / None / absent."""
    return float(value) if value else None


def gguf_per_layer(meta: dict, key: str, layers: int) -> list[int]:
    """A GGUF key that is either one value for every layer or a list of one per layer -> the per-layer ints."""
    value = gguf_key(meta, key)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * layers
    if len(values) != layers:
        arch = meta.get("general.architecture", "?")
        raise DecodertError(f"{arch} GGUF '{key}' lists {len(values)} layers, block_count is {layers}")
    return [int(v) for v in values]

