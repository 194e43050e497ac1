"""Qwen2 / Qwen2.5: Llama layout with a bias on q, k and v."""

from __future__ import annotations

from decodert.errors import DecodertError
from decodert.models.families import llama
from decodert.models.common import spec_from_gguf_meta, spec_from_hf_config
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("qwen2",)
GGUF_ARCHITECTURES = ("qwen2",)

_L = "model.layers.{i}.self_attn."
HF_WEIGHTS = {
    **llama.HF_WEIGHTS,
    "layers.{i}.qkv_bias": (_L + "q_proj.bias", _L + "k_proj.bias", _L + "v_proj.bias"),
}
_B = "blk.{i}."
GGUF_WEIGHTS = {
    **llama.GGUF_WEIGHTS,
    "layers.{i}.qkv_bias": (_B + "attn_q.bias", _B + "attn_k.bias", _B + "attn_v.bias"),
}


def reject_sliding_layers(config: dict) -> None:
    """Qwen2/3 can mix sliding and full layers; decodert has one window for all layers."""
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or ()):
        raise DecodertError("per-layer sliding window attention (use_sliding_window) is not supported")


def spec_from_hf(config: dict) -> ModelSpec:
    reject_sliding_layers(config)
    return spec_from_hf_config("qwen2", config, attention={"qkv_bias": True})


def spec_from_gguf(meta: dict) -> ModelSpec:
    return spec_from_gguf_meta("qwen2", meta, attention={"qkv_bias": True})
