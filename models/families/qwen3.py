"""Qwen3 (dense): Llama layout, explicit head_dim, RMSNorm on q and k per head, no qkv bias."""

from __future__ import annotations

from decodert.errors import DecodertError
from decodert.models.families import llama
from decodert.models.common import spec_from_gguf_meta, spec_from_hf_config
from decodert.models.families.qwen2 import reject_sliding_layers
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("qwen3",)
GGUF_ARCHITECTURES = ("qwen3",)

_L = "model.layers.{i}.self_attn."
HF_WEIGHTS = {
    **llama.HF_WEIGHTS,
    "layers.{i}.q_norm": _L + "q_norm.weight",
    "layers.{i}.k_norm": _L + "k_norm.weight",
}
_B = "blk.{i}."
GGUF_WEIGHTS = {
    **llama.GGUF_WEIGHTS,
    "layers.{i}.q_norm": _B + "attn_q_norm.weight",
    "layers.{i}.k_norm": _B + "attn_k_norm.weight",
}


def spec_from_hf(config: dict) -> ModelSpec:
    if config.get("attention_bias"):
        raise DecodertError("attention_bias=true is not supported for qwen3")
    reject_sliding_layers(config)
    return spec_from_hf_config("qwen3", config, attention={"qk_norm": True})


def spec_from_gguf(meta: dict) -> ModelSpec:
    return spec_from_gguf_meta("qwen3", meta, attention={"qk_norm": True})
