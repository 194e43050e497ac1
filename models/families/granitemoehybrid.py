"""Granite 4.0-H (IBM, transformers ``granitemoehybrid``): Mamba2 layers beside a few attention layers, each layer
followed by a SwiGLU MLP (``shared_mlp``) and, in the MoE models, a mixture of experts beside it.

What differs from Llama (transformers' ``modeling_granitemoehybrid.py``):
- ``layer_types``: "mamba" / "linear_attention" layers (``layer_kinds`` "mamba2": the Mamba2 mixer of
  models/families/nemotron_h.py, the same math) and "attention" / "full_attention" layers;
- attention: softmax scale ``attention_multiplier``; RoPE only with ``position_embedding_type`` "rope"
  (Granite 4.0-H has none: every layer reads the identity rotation);
- embeddings x ``embedding_multiplier``, each mixer and MLP output x ``residual_multiplier`` before its residual
  add (``residual_scale``), logits / ``logits_scaling``;
- the MLP's gate and up rows are one ``input_linear`` (rows gate | up); with ``num_local_experts`` > 0 each
  layer's MLP is the router's top-k experts (softmax over the top-k logits = the renormalised top-k) plus the
  shared MLP (``shared_mlp``); the experts' ``input_linear`` [E, 2 Ie, hidden] holds gate | up halves, which are
  interleaved at load (the canonical experts layout).

    config.json  model_type granitemoehybrid
    GGUF         general.architecture granitehybrid, as llama.cpp's converter writes it: ssm_* as for nemotron_h,
                 the MLP as ffn_gate / ffn_up / ffn_down (ffn_*_shexp beside the experts), head_count_kv per
                 layer (0 for a Mamba2 layer), embedding_scale, residual_scale, logit_scale, attention.scale;
                 no RoPE where rope.scaling.finetuned is false (llama.cpp's rule)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.models.common import (declared, gguf_attention, gguf_key, gguf_mlp, gguf_per_layer, hf_attention, spec_from_gguf_meta,
                                    spec_from_hf_config)
from decodert.models.families import nemotron_h
from decodert.models.layers import AttentionSpec, DenseMLPSpec, LayerSpec, Mamba2Spec, MLPSpec, MoESpec
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("granitemoehybrid",)
TAGS = ('hybrid', 'moe')
GGUF_ARCHITECTURES = ("granitehybrid",)

_L = "model.layers.{i}."
_A = _L + "self_attn."
_M = _L + "mamba."
_E = _L + "block_sparse_moe."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.qkv": (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"),
    "layers.{i}.o": _A + "o_proj.weight",
    "layers.{i}.mamba_in": _M + "in_proj.weight",
    "layers.{i}.mamba_conv": _M + "conv1d.weight",
    "layers.{i}.mamba_conv_bias": _M + "conv1d.bias",
    "layers.{i}.mamba_a_log": _M + "A_log",
    "layers.{i}.mamba_dt_bias": _M + "dt_bias",
    "layers.{i}.mamba_d": _M + "D",
    "layers.{i}.mamba_norm": _M + "norm.weight",
    "layers.{i}.mamba_out": _M + "out_proj.weight",
    "layers.{i}.post_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.gate_up": _L + "shared_mlp.input_linear.weight",
    "layers.{i}.down": _L + "shared_mlp.output_linear.weight",
    "layers.{i}.router": _E + "router.layer.weight",
    "layers.{i}.experts.gate_up": _E + "input_linear.weight[{j}]",  # gate | up halves, interleaved by hf_fix
    "layers.{i}.experts.down": _E + "output_linear.weight[{j}]",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {  # gguf.constants MODEL_ARCH.GRANITE_HYBRID
    **{k: v for k, v in nemotron_h.GGUF_WEIGHTS.items() if k not in ("layers.{i}.post_norm", "layers.{i}.up")},
    "layers.{i}.post_norm": _B + "ffn_norm.weight",
    "layers.{i}.gate_up": (_B + "ffn_gate.weight", _B + "ffn_up.weight"),
    "layers.{i}.down": _B + "ffn_down.weight",
}

# transformers' GraniteMoeHybridConfig defaults a config.json may leave out
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", rms_norm_eps=1e-6, embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
    attention_multiplier=1.0, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=1024,
    position_embedding_type=None, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto",
    mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False, attention_bias=False,
    time_step_limit=(0.0, math.inf), tie_word_embeddings=False,
)
_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}


def layer_kinds(config: dict) -> tuple[str, ...]:
    """``layer_types`` (or ``layers_block_type``) as decodert layer kinds; an unknown kind is refused, named."""
    types = config.get("layer_types") or config.get("layers_block_type")
    layers = int(config.get("num_hidden_layers") or 0)
    if types is None:
        types = ["mamba"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise DecodertError(f"layer_types must list {layers} layers")
    for t in types:
        if t not in _KINDS:
            raise DecodertError(f"layer kind '{t}' is not one decodert knows for granitemoehybrid "
                                f"(known: {', '.join(_KINDS)})")
    return tuple(_KINDS[t] for t in types)


def _check(config: dict) -> None:
    for key, what in (("mamba_proj_bias", "biases on the Mamba2 in/out projections"),
                      ("attention_bias", "biases on the attention projections")):
        if config.get(key):
            raise DecodertError(f"granitemoehybrid {key}=true ({what}) is not supported")
    low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in config["time_step_limit"])
    if low > 0.0 or high < math.inf:
        raise DecodertError(f"granitemoehybrid time_step_limit {[low, high]} is not supported (only [0, inf])")
    if config["position_embedding_type"] not in (None, "rope", "nope"):
        raise DecodertError(f"position_embedding_type '{config['position_embedding_type']}' is not supported")


def spec_from_hf(config: dict) -> ModelSpec:
    config = {**HF_DEFAULTS, **config}
    _check(config)
    kinds = layer_kinds(config)
    hidden, heads = int(config["hidden_size"]), int(config["mamba_n_heads"])
    head_dim = config["mamba_d_head"]
    head_dim = int(config["mamba_expand"]) * hidden // heads if head_dim == "auto" else int(head_dim)
    experts = int(config.get("num_local_experts") or 0)
    shared = declared(DenseMLPSpec, int(config["shared_intermediate_size"]))
    mlp: MLPSpec = shared
    if experts:
        mlp = declared(MoESpec, experts, int(config["num_experts_per_tok"]), int(config["intermediate_size"]), renormalize=True,
                      shared=shared)
    mamba = declared(Mamba2Spec, heads, head_dim, int(config["mamba_d_state"]), int(config["mamba_n_groups"]),
                       kernel=int(config["mamba_d_conv"]), conv_bias=bool(config["mamba_conv_bias"]))
    attention = hf_attention(config, scale=float(config["attention_multiplier"]),
                             rope_table="rope" if config["position_embedding_type"] == "rope" else "rope_none")
    return spec_from_hf_config(
        "granitemoehybrid", config, _layers(kinds, attention, mamba, mlp), check_moe=False,
        rms_norm_eps=float(config["rms_norm_eps"]),
        embed_scale=float(config["embedding_multiplier"]) if config["embedding_multiplier"] != 1 else None,
        residual_scale=float(config["residual_multiplier"]), logits_scaling=float(config["logits_scaling"]))


def _layers(kinds: tuple[str, ...], attention: AttentionSpec, mamba: Mamba2Spec, mlp: MLPSpec) -> tuple[LayerSpec, ...]:
    """Mamba2 and attention layers (no position embedding: attention reads the identity rotation), each with the MLP."""
    return tuple(LayerSpec(attention if kind == "attention" else mamba, mlp) for kind in kinds)


def hf_fix(key: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """An expert's input_linear rows gate | up -> interleaved (gate 0, up 0, gate 1, ...), the canonical layout."""
    if "block_sparse_moe.input_linear.weight[" in key:
        return w.reshape(2, -1, w.shape[-1]).swapaxes(0, 1).reshape(w.shape)
    return w


def spec_from_gguf(meta: dict) -> ModelSpec:
    """llama.cpp's keys: per-layer head_count_kv says each layer's kind (0: Mamba2); the scales as their names."""
    arch = meta.get("general.architecture", "granitehybrid")
    layers = int(gguf_key(meta, "block_count"))
    kv = gguf_per_layer(meta, "attention.head_count_kv", layers)
    heads, inner = int(gguf_key(meta, "ssm.time_step_rank")), int(gguf_key(meta, "ssm.inner_size"))
    if heads < 1 or inner % heads:
        raise DecodertError(f"granitehybrid ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {heads}")
    if meta.get(f"{arch}.expert_count"):
        raise DecodertError("granitehybrid GGUF files with experts are not supported yet (dense MLP only)")
    meta = {**meta, f"{arch}.attention.head_count_kv": max(kv)}
    mamba = declared(Mamba2Spec, heads, inner // heads, int(gguf_key(meta, "ssm.state_size")), int(gguf_key(meta, "ssm.group_count")),
                       kernel=int(gguf_key(meta, "ssm.conv_kernel")), conv_bias=True)
    # llama.cpp's rule: RoPE unless rope.scaling.finetuned is false (how its converter marks Granite 4.0-H's "nope")
    attention = gguf_attention(meta, scale=float(gguf_key(meta, "attention.scale", 0.0)) or None,
                               rope_table="rope" if meta.get(f"{arch}.rope.scaling.finetuned", True) else "rope_none")
    return spec_from_gguf_meta(
        "granitemoehybrid", meta, _layers(tuple("attention" if k else "mamba2" for k in kv), attention, mamba,
                                          gguf_mlp(meta)),
        embed_scale=float(gguf_key(meta, "embedding_scale", 1.0)) if gguf_key(meta, "embedding_scale", 1.0) != 1 else None,
        residual_scale=float(gguf_key(meta, "residual_scale", 1.0)), logits_scaling=float(gguf_key(meta, "logit_scale", 1.0)))


gguf_shape = nemotron_h.gguf_shape
gguf_fix = nemotron_h.gguf_fix
