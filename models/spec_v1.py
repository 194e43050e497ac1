"""Format 1 of the manifest's model section: one flat dict, a key per setting of every layer kind.

Artifacts exported before the layers were declared by kind (``SPEC_FORMAT`` 2, models/spec.py) hold this dict;
``from_flat`` turns it into the format-2 dict of the spec it described (``ModelSpec.from_dict`` reads both), so
those artifacts keep loading. A key the dict lacks takes format 1's default (a dict written before that setting
existed).
"""

from __future__ import annotations

import math
from typing import Any

from decodert.models.layers import (AttentionSpec, DenseMLPSpec, GatedDeltaNetSpec, LayerSpec, Mamba2Spec, MoESpec,
                                    ShortConvSpec, layers_to_dict)
from decodert.models.rope import RopeSpec

SPEC_FORMAT = 2  # ModelSpec.to_dict's layout: 1 = the flat dict (this module), 2 = core + layers by kind

# format 1's keys and their defaults (its required keys: family .. rms_norm_eps)
DEFAULTS: dict[str, Any] = dict(
    max_position=4096, tie_word_embeddings=False, qkv_bias=False, qk_norm=False, sliding_window=None,
    bos_token_id=None, eos_token_ids=(), activation="silu", gated_mlp=True, sandwich_norm=False, embed_scale=None,
    layer_types=(), local_rope=None, attn_scale=None, attn_softcap=None, final_softcap=None, residual_scale=1.0,
    logits_scaling=1.0, attn_output_gate=False, layer_kinds=(), conv_kernel=0, conv_bias=False, linear_key_heads=0,
    linear_value_heads=0, linear_key_dim=0, linear_value_dim=0, ssm_heads=0, ssm_head_dim=0, ssm_state=0,
    ssm_groups=0, num_experts=0, experts_per_token=0, expert_intermediate_size=0, router_renormalize=True,
    mlp_types=(), shared_mlp=False, shared_mlp_gate=False, o_bias=False, attn_sinks=False, router_bias=False,
    expert_bias=False, swiglu_limit=None, swiglu_alpha=1.0, swiglu_beta=0.0, nope_layers=(), per_layer_input_size=0,
    per_layer_vocab=0, layer_scalar=False, v_norm=False, kv_sources=(), mlp_sizes=(), layer_head_dims=(),
    image_token_id=None, mrope_section=(), mrope_interleaved=False, deepstack_layers=0, bidirectional_images=False,
)
REQUIRED = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "rms_norm_eps")


def upgrade_model(d: dict[str, Any]) -> dict[str, Any]:
    """A manifest's model section in today's layout: a format-1 dict converted (its keys no setting names
    kept), any other dict as it is, and so is one that does not convert (the manifest's checks name what is
    wrong with it)."""
    if "layers" in d:
        return d
    try:
        converted = from_flat(d)
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError):
        return d
    return {**{k: v for k, v in d.items() if k not in DEFAULTS and k not in REQUIRED and k != "rope"}, **converted}


def from_flat(d: dict[str, Any]) -> dict[str, Any]:
    """The format-2 dict (ModelSpec.to_dict's) of the spec a format-1 dict describes; ValueError (or KeyError for
    a missing required key) where it describes none."""
    f = {**DEFAULTS, **d}
    for key in REQUIRED:
        if key not in d:
            raise KeyError(key)
    n = int(f["num_layers"])
    if not 0 < n <= 4096:
        raise ValueError(f"num_layers {n} must be 1..4096")
    kinds = tuple(f["layer_kinds"]) or ("attention",) * n
    mlp_types = tuple(f["mlp_types"]) or ("moe" if f["num_experts"] else "dense",) * n
    types = tuple(f["layer_types"])
    for name, values in (("layer_kinds", kinds), ("mlp_types", mlp_types), ("layer_types", types or (None,) * n)):
        if len(values) != n:
            raise ValueError(f"{name} must name {n} layers")
    sliding = [t == "sliding" if types else f["sliding_window"] is not None for t in (types or (None,) * n)]
    if any(sliding) and not f["sliding_window"]:
        raise ValueError("sliding layers need a sliding_window")
    local = None if f["local_rope"] is None else RopeSpec(**f["local_rope"])
    head_dims = tuple(f["layer_head_dims"]) or (f["head_dim"],) * n
    sources = tuple(f["kv_sources"]) or tuple(range(n))
    mlp_sizes = tuple(f["mlp_sizes"]) or (f["intermediate_size"],) * n
    # format 1's scale was 1/sqrt(the model's head_dim) on every layer, whatever the layer's own
    scale = f["attn_scale"]
    if scale is None and set(head_dims) != {f["head_dim"]}:
        scale = 1.0 / math.sqrt(f["head_dim"])

    def attention(i: int) -> AttentionSpec:
        table = "rope_none" if i in f["nope_layers"] else "rope_local" if local is not None and sliding[i] else "rope"
        return AttentionSpec(
            num_heads=f["num_heads"], num_kv_heads=f["num_kv_heads"], head_dim=head_dims[i], qkv_bias=f["qkv_bias"],
            qk_norm=f["qk_norm"], v_norm=f["v_norm"], o_bias=f["o_bias"], sinks=f["attn_sinks"],
            output_gate=f["attn_output_gate"], window=f["sliding_window"] if sliding[i] else None, rope_table=table,
            scale=scale, softcap=f["attn_softcap"], kv_source=None if sources[i] == i else sources[i])

    def mixer(i: int) -> Any:
        kind, k = kinds[i], f["conv_kernel"]
        if kind == "attention":
            return attention(i)
        if kind == "conv":
            return ShortConvSpec(kernel=k, bias=f["conv_bias"])
        if kind == "linear_attention":
            return GatedDeltaNetSpec(f["linear_key_heads"], f["linear_value_heads"], f["linear_key_dim"],
                                     f["linear_value_dim"], kernel=k)
        if kind == "mamba2":
            return Mamba2Spec(f["ssm_heads"], f["ssm_head_dim"], f["ssm_state"], f["ssm_groups"], kernel=k,
                              conv_bias=f["conv_bias"])
        if kind == "none":
            return None
        raise ValueError(f"layer kind '{kind}' is not one of attention, conv, linear_attention, mamba2, none")

    def mlp(i: int) -> Any:
        dense = DenseMLPSpec(mlp_sizes[i], f["activation"], f["gated_mlp"])
        if mlp_types[i] == "dense":
            return dense
        if mlp_types[i] == "moe":
            return MoESpec(f["num_experts"], f["experts_per_token"], f["expert_intermediate_size"],
                           f["router_renormalize"], f["router_bias"], f["expert_bias"], f["swiglu_limit"],
                           f["swiglu_alpha"], f["swiglu_beta"], dense if f["shared_mlp"] else None, f["shared_mlp_gate"])
        if mlp_types[i] == "none":
            return None
        raise ValueError(f"mlp type '{mlp_types[i]}' is not one of dense, moe, none")

    layers = tuple(LayerSpec(mixer(i), mlp(i)) for i in range(n))
    return {
        "spec_format": SPEC_FORMAT, "family": f["family"], "vocab_size": f["vocab_size"], "hidden_size": f["hidden_size"],
        "num_layers": n, "num_heads": f["num_heads"], "num_kv_heads": f["num_kv_heads"], "head_dim": f["head_dim"],
        "rms_norm_eps": f["rms_norm_eps"], "rope": f["rope"], "local_rope": f["local_rope"],
        "mrope": {"section": list(f["mrope_section"]), "interleaved": f["mrope_interleaved"]} if f["mrope_section"] else None,
        "max_position": f["max_position"], "tie_word_embeddings": f["tie_word_embeddings"],
        "bos_token_id": f["bos_token_id"], "eos_token_ids": list(f["eos_token_ids"]), "embed_scale": f["embed_scale"],
        "final_softcap": f["final_softcap"], "logits_scaling": f["logits_scaling"], "residual_scale": f["residual_scale"],
        "sandwich_norm": f["sandwich_norm"], "layer_scalar": f["layer_scalar"],
        "per_layer_inputs": {"size": f["per_layer_input_size"], "vocab": f["per_layer_vocab"],
                             "activation": f["activation"]} if f["per_layer_input_size"] else None,
        "images": None if f["image_token_id"] is None else {
            "token_id": f["image_token_id"], "deepstack_layers": f["deepstack_layers"],
            "bidirectional": f["bidirectional_images"]},
        **layers_to_dict(layers),
    }
