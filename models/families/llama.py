"""Llama family: Llama 2/3 (linear and llama3 rope scaling), TinyLlama, SmolLM2."""

from __future__ import annotations

import dataclasses

import numpy as np

from decodert.errors import DecodertError
from decodert.models.common import spec_from_gguf_meta, spec_from_hf_config
from decodert.models.spec import ModelSpec, RopeSpec

MODEL_TYPES = ("llama",)
GGUF_ARCHITECTURES = ("llama",)

_L = "model.layers.{i}."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.qkv": (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
    "layers.{i}.o": _L + "self_attn.o_proj.weight",
    "layers.{i}.post_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.gate_up": (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    "layers.{i}.down": _L + "mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": (_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.post_norm": _B + "ffn_norm.weight",
    "layers.{i}.gate_up": (_B + "ffn_gate.weight", _B + "ffn_up.weight"),
    "layers.{i}.down": _B + "ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def spec_from_hf(config: dict) -> ModelSpec:
    if config.get("attention_bias"):
        raise DecodertError("attention_bias=true is not supported for llama")
    return spec_from_hf_config("llama", config)


def spec_from_gguf(meta: dict) -> ModelSpec:
    return spec_from_gguf_meta("llama", meta)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order: [n*D, in] -> [n*D, in] in rotate-half order.

    llama.cpp stores head rows as (D/2, 2) pairs; transformers/decodert use (2, D/2).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_fix(key: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Family quirk applied to each GGUF tensor after dequantisation (canonical [out, in] layout)."""
    if key.endswith(".attn_q.weight"):
        return unpermute_rows(w, spec.num_heads)
    if key.endswith(".attn_k.weight"):
        return unpermute_rows(w, spec.num_kv_heads)
    return w


def gguf_rope_freqs(spec: ModelSpec, meta: dict, factors: np.ndarray) -> ModelSpec:
    """Llama 3.1+ GGUFs store llama3 scaling as per-frequency divisors (`rope_freqs.weight`).

    RopeSpec is parametric, so accept the file when some llama3 parameters reproduce the factors.
    """
    base = RopeSpec(theta=spec.rope.theta, rotary_dim=spec.rope.rotary_dim)
    orig = int(meta.get("llama.rope.scaling.original_context_length", 8192))
    target = base.inv_freq(spec.head_dim) / factors.astype(np.float64)  # [rot/2]
    for factor in (8.0, 32.0, 16.0, 4.0, 2.0, round(float(factors.max()), 3)):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            rope = dataclasses.replace(base, scaling="llama3", factor=factor, low_freq_factor=low,
                                       high_freq_factor=high, original_max_position=orig)
            if np.allclose(rope.inv_freq(spec.head_dim), target, rtol=1e-4):
                return dataclasses.replace(spec, rope=rope)
    raise DecodertError("rope_freqs.weight does not match llama3 rope scaling; not supported yet")
