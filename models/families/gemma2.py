"""Gemma 2: Gemma 3's layout without q/k norm and with one RoPE for every layer, sliding and full
layers alternating, and tanh soft-capping of the attention scores and of the final logits.

    config.json  model_type gemma2
    GGUF         general.architecture gemma2 (llama.cpp: norms stored as 1 + w; sliding and full
                 layers alternate; the softmax scale is llama.cpp's rule unless stored)
"""

from __future__ import annotations

from typing import Any

from decodert.models.families import gemma3
from decodert.models.common import spec_from_gguf_meta, spec_from_hf_config
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("gemma2",)
GGUF_ARCHITECTURES = ("gemma2",)

_NO_QK_NORM = ("layers.{i}.q_norm", "layers.{i}.k_norm")
HF_WEIGHTS = {k: v for k, v in gemma3.HF_WEIGHTS.items() if k not in _NO_QK_NORM}
GGUF_WEIGHTS = {k: v for k, v in gemma3.GGUF_WEIGHTS.items() if k not in _NO_QK_NORM}
hf_fix = gemma3.hf_fix  # (1 + w) norms

# transformers' Gemma2Config defaults (soft-capping on: 50 for the scores, 30 for the logits).
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    rope_theta=10_000.0, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=2,
    final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
)


def spec_from_hf(config: dict) -> ModelSpec:
    config = {**HF_DEFAULTS, **config}
    return spec_from_hf_config("gemma2", config, **gemma3.hf_gemma_fields("gemma2", config))


def spec_from_gguf(meta: dict) -> ModelSpec:
    return spec_from_gguf_meta("gemma2", meta, **gemma3.gguf_gemma_fields(meta, pattern=2, large_layers=46))
