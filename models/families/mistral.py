"""Mistral: Llama layout plus an optional sliding attention window."""

from __future__ import annotations

from decodert.errors import DecodertError
from decodert.models.families import llama
from decodert.models.common import gguf_key, spec_from_gguf_meta, spec_from_hf_config
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("mistral",)
GGUF_ARCHITECTURES = ("mistral",)
HF_WEIGHTS = llama.HF_WEIGHTS
GGUF_WEIGHTS = llama.GGUF_WEIGHTS
gguf_fix = llama.gguf_fix  # llama.cpp's converter permutes q/k for Mistral too


def spec_from_hf(config: dict) -> ModelSpec:
    if config.get("attention_bias"):
        raise DecodertError("attention_bias=true is not supported for mistral")
    window = config.get("sliding_window")
    return spec_from_hf_config("mistral", config, attention={"window": int(window) if window else None})


def spec_from_gguf(meta: dict) -> ModelSpec:
    window = gguf_key(meta, "attention.sliding_window", None)
    return spec_from_gguf_meta("mistral", meta, attention={"window": int(window) if window else None})
