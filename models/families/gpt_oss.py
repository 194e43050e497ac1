"""gpt-oss: sliding (128) and full attention layers in turn, attention sinks, YaRN RoPE, biases on
q/k/v/o, the router and every expert; clamped SwiGLU experts with gate/up interleaved.

    router   = h @ W^T + b; top-k of the logits, softmax over those k (= softmax, top-k, renormalised)
    expert   = down(glu) + b_down,  glu = gate * sigmoid(1.702 gate) * (up + 1),
               gate = min(g, 7), up = clip(u, -7, 7), (g, u) interleaved in gate_up(h) + b_gate_up

transformers stores the experts stacked and transposed (gate_up_proj [E, hidden, 2 Ie], down_proj
[E, Ie, hidden]): the table reads one expert (``[{j}]``), transposed to [out, in] (``.T``).
OpenAI's checkpoints store them as MXFP4 (``*_blocks`` + ``*_scales``): the Hugging Face reader
dequantizes them exactly, one expert at a time (export/quantize/mxfp4.py).
"""

from __future__ import annotations

import dataclasses
import math

from decodert.errors import DecodertError
from decodert.models.common import (declared, f32, gguf_attention, gguf_key, gguf_layers, hf_attention, hf_layers,
                                    spec_from_gguf_meta, spec_from_hf_config)
from decodert.models.layers import AttentionSpec, LayerSpec, MoESpec
from decodert.models.spec import ModelSpec, RopeSpec

MODEL_TYPES = ("gpt_oss",)
TAGS = ('moe',)
GGUF_ARCHITECTURES = ("gpt-oss",)

_L = "model.layers.{i}."
_A = _L + "self_attn."
_E = _L + "mlp.experts."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.qkv": (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"),
    "layers.{i}.qkv_bias": (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"),
    "layers.{i}.o": _A + "o_proj.weight",
    "layers.{i}.o_bias": _A + "o_proj.bias",
    "layers.{i}.sinks": _A + "sinks",
    "layers.{i}.post_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.router": _L + "mlp.router.weight",
    "layers.{i}.router_bias": _L + "mlp.router.bias",
    "layers.{i}.experts.gate_up": _E + "gate_up_proj[{j}].T",  # .T: stored [hidden, 2 Ie], read [2 Ie, hidden]
    "layers.{i}.experts.gate_up_bias": _E + "gate_up_proj_bias[{j}]",
    "layers.{i}.experts.down": _E + "down_proj[{j}].T",
    "layers.{i}.experts.down_bias": _E + "down_proj_bias[{j}]",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_B = "blk.{i}."
# llama.cpp's converter splits the interleaved gate_up into ffn_gate_exps and ffn_up_exps (stacked [E, ...],
# MXFP4 or float); the table fuses them back, interleaved, one expert at a time.
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": (_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
    "layers.{i}.qkv_bias": (_B + "attn_q.bias", _B + "attn_k.bias", _B + "attn_v.bias"),
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.o_bias": _B + "attn_output.bias",
    "layers.{i}.sinks": _B + "attn_sinks.weight",
    "layers.{i}.post_norm": _B + "post_attention_norm.weight",
    "layers.{i}.router": _B + "ffn_gate_inp.weight",
    "layers.{i}.router_bias": _B + "ffn_gate_inp.bias",
    "layers.{i}.experts.gate_up": (_B + "ffn_gate_exps.weight[{j}]", _B + "ffn_up_exps.weight[{j}]"),
    "layers.{i}.experts.gate_up_bias": (_B + "ffn_gate_exps.bias[{j}]", _B + "ffn_up_exps.bias[{j}]"),
    "layers.{i}.experts.down": _B + "ffn_down_exps.weight[{j}]",
    "layers.{i}.experts.down_bias": _B + "ffn_down_exps.bias[{j}]",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}

HF_DEFAULTS = dict(swiglu_limit=7.0, sliding_window=128, head_dim=64, attention_bias=True)
SWIGLU_ALPHA = 1.702  # fixed in transformers' GptOssExperts (config.swiglu_alpha when present)


def _layer_types(config: dict, layers: int) -> tuple[str, ...]:
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    known = {"sliding_attention": "sliding", "full_attention": "full"}
    if not isinstance(types, list) or len(types) != layers or any(t not in known for t in types):
        raise DecodertError(f"layer_types must list {layers} of sliding_attention / full_attention")
    return tuple(known[t] for t in types)


def spec_from_hf(config: dict) -> ModelSpec:
    config = {**HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if not config.get("attention_bias"):
        raise DecodertError("gpt_oss without attention_bias is not a layout decodert maps")
    experts = config.get("num_local_experts", config.get("num_experts"))
    if not experts:
        raise DecodertError("gpt_oss config has no num_local_experts (a router needs experts)")
    limit = config.get("swiglu_limit")
    moe = declared(MoESpec, int(experts), int(config.get("num_experts_per_tok", 4)), int(config["intermediate_size"]),
                  router_bias=True, expert_bias=True, swiglu_limit=None if limit is None else float(limit),
                  swiglu_alpha=float(config.get("swiglu_alpha", SWIGLU_ALPHA)), swiglu_beta=1.0)
    return spec_from_hf_config("gpt_oss", config, _layers(_layer_types(config, hf_layers(config)),
                                                          hf_attention(config, **ATTENTION), moe,
                                                          int(config["sliding_window"])), check_moe=False)


ATTENTION = dict(qkv_bias=True, o_bias=True, sinks=True)


def _layers(types: tuple[str, ...], attention: AttentionSpec, moe: MoESpec, window: int) -> tuple[LayerSpec, ...]:
    """Sliding and full attention layers in turn, every MLP the experts."""
    sliding = dataclasses.replace(attention, window=window)
    return tuple(LayerSpec(sliding if t == "sliding" else attention, moe) for t in types)


def spec_from_gguf(meta: dict) -> ModelSpec:
    """llama.cpp's gpt-oss metadata, and its fixed rules where it stores none: sliding layers are the even
    ones, SwiGLU limit 7 and alpha 1.702; YaRN as the Hugging Face config has it (betas 32/1 unless stored,
    no truncation, attention factor 0.1 ln(factor) + 1)."""
    layers = gguf_layers(meta)
    arch = meta.get("general.architecture", "gpt-oss")
    meta = {f"{arch}.feed_forward_length": gguf_key(meta, "expert_feed_forward_length"), **meta}
    theta = f32(gguf_key(meta, "rope.freq_base", 150000.0))
    if gguf_key(meta, "rope.scaling.type", "yarn") != "yarn":
        raise DecodertError("gpt-oss GGUF with rope scaling other than yarn is not a layout decodert maps")
    factor = f32(gguf_key(meta, "rope.scaling.factor", 32.0))
    rope = RopeSpec(theta=theta, scaling="yarn", factor=factor,
                    original_max_position=int(gguf_key(meta, "rope.scaling.original_context_length", 4096)),
                    beta_fast=f32(gguf_key(meta, "rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=f32(gguf_key(meta, "rope.scaling.yarn_beta_slow", 1.0)), truncate=False,
                    attention_factor=0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    plain = {k: v for k, v in meta.items() if k != f"{arch}.rope.scaling.type"}  # the YaRN read above replaces it
    moe = declared(MoESpec, int(gguf_key(meta, "expert_count")), int(gguf_key(meta, "expert_used_count")),
                  int(gguf_key(meta, "expert_feed_forward_length")), router_bias=True, expert_bias=True,
                  swiglu_limit=7.0, swiglu_alpha=SWIGLU_ALPHA, swiglu_beta=1.0)
    types = tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    return spec_from_gguf_meta("gpt_oss", plain, _layers(types, gguf_attention(plain, **ATTENTION), moe,
                                                         int(gguf_key(meta, "attention.sliding_window", 128))),
                               rope=rope, check_moe=False)
