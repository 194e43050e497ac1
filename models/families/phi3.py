"""Phi-3 (mini/medium, no longrope): q/k/v and gate/up come already fused; optional partial rotary."""

from __future__ import annotations

from dataclasses import replace

from decodert.errors import DecodertError
from decodert.models.common import gguf_key, partial_rotary_factor, spec_from_gguf_meta, spec_from_hf_config
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("phi3",)
GGUF_ARCHITECTURES = ("phi3",)

_L = "model.layers.{i}."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.qkv": _L + "self_attn.qkv_proj.weight",
    "layers.{i}.o": _L + "self_attn.o_proj.weight",
    "layers.{i}.post_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.gate_up": _L + "mlp.gate_up_proj.weight",
    "layers.{i}.down": _L + "mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": _B + "attn_qkv.weight",
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.post_norm": _B + "ffn_norm.weight",
    "layers.{i}.gate_up": _B + "ffn_up.weight",  # llama.cpp keeps Phi-3's fused gate_up as ffn_up
    "layers.{i}.down": _B + "ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def spec_from_hf(config: dict) -> ModelSpec:
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise DecodertError(f"rope scaling '{kind}' is not supported yet")
    window = config.get("sliding_window")
    spec = spec_from_hf_config("phi3", config, attention={"window": int(window) if window else None})
    rot = int(spec.head_dim * partial_rotary_factor(config))
    return spec if rot == spec.head_dim else replace(spec, rope=replace(spec.rope, rotary_dim=rot))


def spec_from_gguf(meta: dict) -> ModelSpec:
    window = gguf_key(meta, "attention.sliding_window", None)
    return spec_from_gguf_meta("phi3", meta, attention={"window": int(window) if window else None})
