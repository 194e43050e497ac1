"""LFM2 (LiquidAI): gated short convolutions beside GQA attention with q/k norms.

Each layer mixes tokens either with attention (``full_attention``: Qwen3's q/k RMSNorm, no bias) or
with a gated depthwise causal convolution (``conv``):
    b, c, x = split(in_proj(h));  y = out_proj(c * conv1d(b * x))      kernel conv_L_cache, state K-1
then a SwiGLU MLP (w1 gate, w3 up, w2 down). The final norm is named ``embedding_norm`` but sits
after the last layer. The spec declares the per-layer kinds (``layer_kinds``) and the kernel
(``conv_kernel``); the graph recipe gives each conv layer a rolling state [B, hidden, K-1].
"""

from __future__ import annotations

from typing import Any

from decodert.errors import DecodertError
from decodert.models.common import (declared, gguf_attention, gguf_mlp, hf_attention, hf_layers, spec_from_gguf_meta,
                                    spec_from_hf_config)
from decodert.models.layers import AttentionSpec, DenseMLPSpec, LayerSpec, ShortConvSpec
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("lfm2",)
TAGS = ('hybrid',)
GGUF_ARCHITECTURES = ("lfm2",)

# transformers' Lfm2Config defaults a config.json may leave out
HF_DEFAULTS: dict[str, Any] = dict(norm_eps=1e-5, conv_L_cache=3, conv_bias=False, block_multiple_of=256,
                                   block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                                   tie_word_embeddings=True, rope_theta=1000000.0)
_KINDS = {"full_attention": "attention", "conv": "conv"}  # LFM2 layer_types -> decodert layer kinds

_L = "model.layers.{i}."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "operator_norm.weight",
    "layers.{i}.qkv": (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
    "layers.{i}.q_norm": _L + "self_attn.q_layernorm.weight",
    "layers.{i}.k_norm": _L + "self_attn.k_layernorm.weight",
    "layers.{i}.o": _L + "self_attn.out_proj.weight",
    "layers.{i}.conv_in": _L + "conv.in_proj.weight",
    "layers.{i}.conv_in_bias": _L + "conv.in_proj.bias",
    "layers.{i}.conv": _L + "conv.conv.weight",
    "layers.{i}.conv_bias": _L + "conv.conv.bias",
    "layers.{i}.conv_out": _L + "conv.out_proj.weight",
    "layers.{i}.conv_out_bias": _L + "conv.out_proj.bias",
    "layers.{i}.post_norm": _L + "ffn_norm.weight",
    "layers.{i}.gate_up": (_L + "feed_forward.w1.weight", _L + "feed_forward.w3.weight"),
    "layers.{i}.down": _L + "feed_forward.w2.weight",
    "final_norm": "model.embedding_norm.weight",
    "lm_head": "lm_head.weight",
}

# llama.cpp's names (gguf.constants MODEL_ARCH.LFM2): the final norm is token_embd_norm there too; no conv biases
# (llama.cpp's LFM2 has none)
_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": (_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
    "layers.{i}.q_norm": _B + "attn_q_norm.weight",
    "layers.{i}.k_norm": _B + "attn_k_norm.weight",
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.conv_in": _B + "shortconv.in_proj.weight",
    "layers.{i}.conv": _B + "shortconv.conv.weight",
    "layers.{i}.conv_out": _B + "shortconv.out_proj.weight",
    "layers.{i}.post_norm": _B + "ffn_norm.weight",
    "layers.{i}.gate_up": (_B + "ffn_gate.weight", _B + "ffn_up.weight"),
    "layers.{i}.down": _B + "ffn_down.weight",
    "final_norm": "token_embd_norm.weight",
    "lm_head": "output.weight",
}


def hf_layer_kinds(config: dict, layers: int) -> tuple[str, ...]:
    """``layer_types`` (or the older ``full_attn_idxs``) as decodert layer kinds; an unknown kind is refused."""
    types = config.get("layer_types")
    if types is None:
        full = set(config.get("full_attn_idxs") or range(layers))
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    if len(types) != layers:
        raise DecodertError(f"layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    for kind in types:
        if kind not in _KINDS:
            raise DecodertError(f"layer kind '{kind}' is not one decodert knows for lfm2 (known: {', '.join(_KINDS)})")
    return tuple(_KINDS[t] for t in types)


def ffn_size(config: dict) -> int:
    """The MLP width transformers builds (Lfm2MLP: 2/3 of intermediate_size, times the multiplier, rounded up)."""
    size = int(config["intermediate_size"])
    if config["block_auto_adjust_ff_dim"]:
        size = int(2 * size / 3)
        if config["block_ffn_dim_multiplier"] is not None:
            size = int(config["block_ffn_dim_multiplier"] * size)
            multiple = int(config["block_multiple_of"])
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def spec_from_hf(config: dict) -> ModelSpec:
    config = {**HF_DEFAULTS, **config}
    config["intermediate_size"] = config.get("block_ff_dim", config.get("intermediate_size"))
    config["tie_word_embeddings"] = config.get("tie_embedding", config["tie_word_embeddings"])
    if config.get("intermediate_size") is None:
        raise DecodertError("config.json has no 'intermediate_size'")
    hidden, heads = int(config.get("hidden_size") or 0), int(config.get("num_attention_heads") or 1)
    config = {**config, "head_dim": hidden // heads}
    conv = declared(ShortConvSpec, int(config["conv_L_cache"]), bias=bool(config["conv_bias"]))
    return spec_from_hf_config("lfm2", config, _layers(hf_layer_kinds(config, hf_layers(config)),
                                                       hf_attention(config, qk_norm=True), conv, declared(DenseMLPSpec, ffn_size(config))),
                               rms_norm_eps=float(config["norm_eps"]), tie_word_embeddings=bool(config["tie_word_embeddings"]))


def _layers(kinds: tuple[str, ...], attention: AttentionSpec, conv: ShortConvSpec,
            mlp: DenseMLPSpec) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(attention if kind == "attention" else conv, mlp) for kind in kinds)


def spec_from_gguf(meta: dict) -> ModelSpec:
    """llama.cpp keeps the K/V heads per layer (0 for a conv layer), the kernel as shortconv.l_cache and
    the MLP width already adjusted; the q/k rows are not permuted (NeoX rotary)."""
    arch = meta.get("general.architecture", "lfm2")
    per_layer = meta.get(f"{arch}.attention.head_count_kv")
    if not isinstance(per_layer, (list, tuple)) or not any(per_layer):
        raise DecodertError(f"lfm2 GGUF metadata has no per-layer '{arch}.attention.head_count_kv'")
    if f"{arch}.shortconv.l_cache" not in meta:
        raise DecodertError(f"lfm2 GGUF metadata has no '{arch}.shortconv.l_cache'")
    kinds = tuple("attention" if n else "conv" for n in per_layer)
    meta = {**meta, f"{arch}.attention.head_count_kv": max(int(n) for n in per_layer)}
    conv = declared(ShortConvSpec, int(meta[f"{arch}.shortconv.l_cache"]))
    return spec_from_gguf_meta("lfm2", meta, _layers(kinds, gguf_attention(meta, qk_norm=True), conv, gguf_mlp(meta)))


def gguf_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """llama.cpp's converter stores the conv taps squeezed, [C, K]; canonical is ONNX Conv's [C, 1, K]."""
    return (shape[0], 1, shape[1]) if key.endswith("shortconv.conv.weight") and len(shape) == 2 else shape
