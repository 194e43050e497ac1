"""SmolLM3: Llama's layout; every ``no_rope_layer_interval``-th layer (NoPE) attends without RoPE.

transformers' ``no_rope_layers`` lists one flag per layer (1 = RoPE, 0 = none); when absent it is
built from ``no_rope_layer_interval`` (layer i has no RoPE when (i + 1) % interval == 0). llama.cpp
stores neither and applies its fixed rule for the architecture, an interval of 4, as does this
reader. The template's thinking switch (``/think``, ``/no_think``, ``enable_thinking``) is the
chat template's; the reply's ``<think>`` block comes back as reasoning (runtime/chat/output.py).
"""

from __future__ import annotations

import dataclasses

from decodert.errors import DecodertError
from decodert.models.families import llama
from decodert.models.common import (gguf_attention, gguf_mlp, hf_attention, hf_layers, hf_mlp, spec_from_gguf_meta,
                                    spec_from_hf_config)
from decodert.models.layers import AttentionSpec, LayerSpec
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("smollm3",)
GGUF_ARCHITECTURES = ("smollm3",)

HF_WEIGHTS = llama.HF_WEIGHTS
GGUF_WEIGHTS = llama.GGUF_WEIGHTS
gguf_fix = llama.gguf_fix  # llama.cpp's converter permutes q/k rows as for Llama
GGUF_NO_ROPE_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for smollm3


def nope_layers(config: dict, layers: int) -> tuple[int, ...]:
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise DecodertError(f"no_rope_layer_interval {interval!r} must be a positive integer")
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise DecodertError(f"no_rope_layers must list {layers} flags of 0 or 1 (1 = the layer uses RoPE)")
    return tuple(i for i, f in enumerate(flags) if not f)


def spec_from_hf(config: dict) -> ModelSpec:
    if config.get("attention_bias"):
        raise DecodertError("attention_bias=true is not supported for smollm3")
    if config.get("use_sliding_window"):
        raise DecodertError("use_sliding_window=true is not supported for smollm3")
    nope = nope_layers(config, hf_layers(config))
    attention, mlp = hf_attention(config), hf_mlp(config)
    return spec_from_hf_config("smollm3", config, lambda i: LayerSpec(_no_rope(attention) if i in nope else attention, mlp),
                               rope=_hf_rope(config))


def _no_rope(attention: AttentionSpec) -> AttentionSpec:
    return dataclasses.replace(attention, rope_table="rope_none")


def _hf_rope(config: dict):
    from decodert.models.common import hf_rope

    if "rope_theta" not in config and "rope_theta" not in (config.get("rope_parameters") or {}):
        config = {**config, "rope_theta": 2000000.0}  # SmolLM3Config's default
    return hf_rope(config)


def spec_from_gguf(meta: dict) -> ModelSpec:
    attention, mlp = gguf_attention(meta), gguf_mlp(meta)
    return spec_from_gguf_meta("smollm3", meta, lambda i: LayerSpec(
        _no_rope(attention) if (i + 1) % GGUF_NO_ROPE_INTERVAL == 0 else attention, mlp))
