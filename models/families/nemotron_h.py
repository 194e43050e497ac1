"""Nemotron-H (NVIDIA): Mamba2 blocks beside a few attention blocks and ReLU² MLP blocks.

Each block of the checkpoint is ``x = x + mixer(rmsnorm(x))`` with one mixer (transformers'
``modeling_nemotron_h.py``, ``NemotronHBlock``), the kind per block from ``hybrid_override_pattern``
("M" Mamba2, "*" attention, "-" MLP, "E" MoE) or ``layers_block_type``. A decodert layer is a block:
- "M": ``layer_kinds`` "mamba2", ``mlp_types`` "none" (its norm is the input_norm);
- "*": "attention" (GQA without any position embedding: every layer reads the identity rotation), "none";
- "-": ``layer_kinds`` "none", ``mlp_types`` "dense" (its norm is the post_norm): down(relu(up)²), not gated;
- "E" (the MoE of Nemotron-3 Nano) is refused.
Every norm multiplies by plain w; the final one is ``norm_f``.

    config.json  model_type nemotron_h; weights under ``backbone.`` (as NVIDIA ships them) or ``model.``
                 (as transformers 5 saves them); the MTP head is dropped
    GGUF         general.architecture nemotron_h, as llama.cpp's converter writes it: every block's norm is
                 attn_norm; ssm_a = -exp(A_log) [H, 1], ssm_d [H, 1], ssm_norm [G, Di/G], the conv
                 squeezed to [C, K]; a block is attention where head_count_kv > 0, MLP where
                 feed_forward_length > 0, Mamba2 otherwise
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.models.common import (declared, gguf_per_layer, gguf_attention, gguf_key, gguf_layers, gguf_mlp, hf_attention, hf_mlp,
                                    spec_from_gguf_meta, spec_from_hf_config)
from decodert.models.layers import AttentionSpec, DenseMLPSpec, LayerSpec, Mamba2Spec
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("nemotron_h",)
TAGS = ('hybrid',)
GGUF_ARCHITECTURES = ("nemotron_h",)

_L = "model.layers.{i}."
_M = _L + "mixer."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embeddings.weight",
    "layers.{i}.input_norm": _L + "norm.weight",
    "layers.{i}.post_norm": _L + "norm.weight",  # an MLP block's one norm
    "layers.{i}.qkv": (_M + "q_proj.weight", _M + "k_proj.weight", _M + "v_proj.weight"),
    "layers.{i}.o": _M + "o_proj.weight",
    "layers.{i}.mamba_in": _M + "in_proj.weight",
    "layers.{i}.mamba_conv": _M + "conv1d.weight",
    "layers.{i}.mamba_conv_bias": _M + "conv1d.bias",
    "layers.{i}.mamba_a_log": _M + "A_log",
    "layers.{i}.mamba_dt_bias": _M + "dt_bias",
    "layers.{i}.mamba_d": _M + "D",
    "layers.{i}.mamba_norm": _M + "norm.weight",
    "layers.{i}.mamba_out": _M + "out_proj.weight",
    "layers.{i}.up": _M + "up_proj.weight",
    "layers.{i}.down": _M + "down_proj.weight",
    "final_norm": "model.norm_f.weight",
    "lm_head": "lm_head.weight",
}

_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {  # gguf.constants MODEL_ARCH.NEMOTRON_H
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.post_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": (_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.mamba_in": _B + "ssm_in.weight",
    "layers.{i}.mamba_conv": _B + "ssm_conv1d.weight",
    "layers.{i}.mamba_conv_bias": _B + "ssm_conv1d.bias",
    "layers.{i}.mamba_a_log": _B + "ssm_a",
    "layers.{i}.mamba_dt_bias": _B + "ssm_dt.bias",
    "layers.{i}.mamba_d": _B + "ssm_d",
    "layers.{i}.mamba_norm": _B + "ssm_norm.weight",
    "layers.{i}.mamba_out": _B + "ssm_out.weight",
    "layers.{i}.up": _B + "ffn_up.weight",
    "layers.{i}.down": _B + "ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}

# transformers' NemotronHConfig defaults a config.json may leave out
HF_DEFAULTS: dict[str, Any] = dict(
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504, mlp_hidden_act="relu2",
    ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4,
    use_conv_bias=True, use_bias=False, mlp_bias=False, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    max_position_embeddings=4096, time_step_limit=(0.0, math.inf),
)
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# block type (pattern letter, transformers' name or its legacy one) -> (layer kind, mlp type)
_BLOCKS = {"mamba": ("mamba2", "none"), "linear_attention": ("mamba2", "none"), "attention": ("attention", "none"),
           "full_attention": ("attention", "none"), "mlp": ("none", "dense")}
_LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
                "mamba_dt_limit": "time_step_limit", "attention_head_dim": "head_dim"}


def sanitize(key: str) -> str | None:
    """NVIDIA's ``backbone.`` prefix -> transformers' ``model.``; the MTP head dropped."""
    if key.startswith("mtp."):
        return None
    return "model." + key[len("backbone."):] if key.startswith("backbone.") else key


def block_types(config: dict) -> list[str]:
    """Each block's type: ``layers_block_type`` / ``layer_types`` (a list) or ``hybrid_override_pattern``."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if types is None:
        pattern = config.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise DecodertError("a nemotron_h config.json needs 'hybrid_override_pattern' or 'layers_block_type'")
        types = [_PATTERN.get(ch, ch) for ch in pattern]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise DecodertError("layers_block_type must be a list of block type names")
    return types


def layer_plan(types: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(layer_kinds, mlp_types) of the blocks; an unknown block type and MoE blocks are refused, naming them."""
    for t in types:
        if t == "moe":
            raise DecodertError("nemotron_h MoE blocks ('E', Nemotron-3 Nano) are not supported (dense MLP blocks only)")
        if t not in _BLOCKS:
            raise DecodertError(f"layer kind '{t}' is not one decodert knows for nemotron_h "
                                f"(known: {', '.join(_BLOCKS)})")
    return tuple(_BLOCKS[t][0] for t in types), tuple(_BLOCKS[t][1] for t in types)


def block_layers(types: list[str], attention: AttentionSpec, mamba: Mamba2Spec, mlp: DenseMLPSpec) -> tuple[LayerSpec, ...]:
    """One layer per block: a Mamba2 or attention mixer alone (attention without position embedding: the
    identity rotation), or an MLP alone."""
    kinds, mlps = layer_plan(types)
    mixers = {"attention": dataclasses.replace(attention, rope_table="rope_none"), "mamba2": mamba, "none": None}
    return tuple(LayerSpec(mixers[k], mlp if m == "dense" else None) for k, m in zip(kinds, mlps))


def _check(config: dict) -> None:
    if config.get("use_bias"):
        raise DecodertError("nemotron_h use_bias=true (biases on the Mamba2 in/out projections) is not supported")
    if config["mlp_hidden_act"] != "relu2":
        raise DecodertError(f"nemotron_h mlp_hidden_act '{config['mlp_hidden_act']}' is not supported (relu2 only)")
    if config["mamba_hidden_act"] not in ("silu", "swish"):
        raise DecodertError(f"nemotron_h mamba_hidden_act '{config['mamba_hidden_act']}' is not supported (silu only)")
    low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in config["time_step_limit"])
    if low > 0.0 or high < math.inf:
        raise DecodertError(f"nemotron_h time_step_limit {[low, high]} is not supported (only the default [0, inf])")


def spec_from_hf(config: dict) -> ModelSpec:
    config = {**HF_DEFAULTS, **{_LEGACY_KEYS.get(k, k): v for k, v in config.items()}}
    _check(config)
    types = block_types(config)
    config = {**config, "num_hidden_layers": len(types)}
    mamba = declared(Mamba2Spec, int(config["mamba_num_heads"]), int(config["mamba_head_dim"]), int(config["ssm_state_size"]),
                       int(config["n_groups"]), kernel=int(config["conv_kernel"]), conv_bias=bool(config["use_conv_bias"]))
    layers = block_layers(types, hf_attention(config), mamba, hf_mlp(config, **MLP))
    # check_moe=False: the config's MoE settings (defaults in every config.json) serve no block here
    return spec_from_hf_config("nemotron_h", config, layers, check_moe=False, check_activation=False,
                               rms_norm_eps=float(config["layer_norm_epsilon"]))


MLP = dict(activation="relu2", gated=False)  # down(relu(up)^2)



def spec_from_gguf(meta: dict) -> ModelSpec:
    """llama.cpp's keys: per-layer head_count_kv and feed_forward_length say each block's type; ssm.* the
    Mamba2 sizes (inner_size = H Dh, time_step_rank = H)."""
    arch = meta.get("general.architecture", "nemotron_h")
    layers = gguf_layers(meta)
    kv, ffn = gguf_per_layer(meta, "attention.head_count_kv", layers), gguf_per_layer(meta, "feed_forward_length", layers)
    types = ["attention" if k else "mlp" if f else "mamba" for k, f in zip(kv, ffn)]
    heads, inner = int(gguf_key(meta, "ssm.time_step_rank")), int(gguf_key(meta, "ssm.inner_size"))
    if heads < 1 or inner % heads:
        raise DecodertError(f"nemotron_h ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {heads}")
    meta = {**meta, f"{arch}.attention.head_count_kv": max(kv), f"{arch}.feed_forward_length": max(ffn)}
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon", meta.get(f"{arch}.attention.layer_norm_epsilon"))
    if eps is not None:  # llama.cpp reads nemotron_h's RMS epsilon from layer_norm_epsilon
        meta[f"{arch}.attention.layer_norm_rms_epsilon"] = eps
    mamba = declared(Mamba2Spec, heads, inner // heads, int(gguf_key(meta, "ssm.state_size")), int(gguf_key(meta, "ssm.group_count")),
                       kernel=int(gguf_key(meta, "ssm.conv_kernel")), conv_bias=True)
    return spec_from_gguf_meta("nemotron_h", meta, block_layers(types, gguf_attention(meta), mamba, gguf_mlp(meta, **MLP)),
                               check_moe=False)


def gguf_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """llama.cpp's shapes -> the checkpoint's: the conv [C, K] -> [C, 1, K]; A and D [H, 1] -> [H]; the gated
    norm [G, Di/G] -> [Di]."""
    if key.endswith("ssm_conv1d.weight") and len(shape) == 2:
        return (shape[0], 1, shape[1])
    if key.endswith(("ssm_a", "ssm_d", "ssm_norm.weight")) and len(shape) == 2:
        return (shape[0] * shape[1],)
    return shape


def gguf_fix(key: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Undo llama.cpp's converter: A_log from ssm_a = -exp(A_log) (shapes: ``gguf_shape``)."""
    return np.log(-w) if key.endswith("ssm_a") else w
