"""Qwen2.5-VL: a window-attention ViT with 2-D rotary, a 2x2 patch merger and a Qwen2 text model with M-RoPE.

    config.json  model_type qwen2_5_vl: ``text_config`` (transformers 5) or the top level (4.x) is a Qwen2
                 config whose rope has ``mrope_section`` (pairs per axis t, h, w); ``vision_config`` the ViT
                 (depth, hidden_size, num_heads, patch_size 14, temporal_patch_size 2, spatial_merge_size 2,
                 window_size 112, fullatt_block_indexes); ``image_token_id`` = <|image_pad|>
    weights      transformers 5: model.language_model.*, model.visual.*, lm_head.*;
                 the Hub's 4.x files: model.*, visual.*, lm_head.* (``sanitize`` maps the first to the second)

The text model is Qwen2's tables (qkv bias) with ``mrope_section`` (plugins/ops/mrope.py: the graphs take
rope_offsets, runtime/vision/mrope.py computes them from a row's ids); the tower is VisionSpec's
``qwen_vit`` (export/lowering/vision_qwen.py), its preprocessing runtime/vision/qwen_preprocess.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decodert.errors import DecodertError
from decodert.models.families import qwen2
from decodert.models.spec import ImageTokens, ModelSpec, MRopeSpec
from decodert.models.vision import VisionSpec

MODEL_TYPES = ("qwen2_5_vl",)
TAGS = ('vision',)

HF_WEIGHTS = qwen2.HF_WEIGHTS
_V = "visual."
_VL = _V + "blocks.{i}."
VISION_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "vision.patch_embed": _V + "patch_embed.proj.weight",  # [C, 3, T, P, P] read as [C, 3 T P P]
    "vision.layers.{i}.norm1": _VL + "norm1.weight",
    "vision.layers.{i}.qkv": _VL + "attn.qkv.weight",
    "vision.layers.{i}.qkv_bias": _VL + "attn.qkv.bias",
    "vision.layers.{i}.o": _VL + "attn.proj.weight",
    "vision.layers.{i}.o_bias": _VL + "attn.proj.bias",
    "vision.layers.{i}.norm2": _VL + "norm2.weight",
    "vision.layers.{i}.gate_up": (_VL + "mlp.gate_proj.weight", _VL + "mlp.up_proj.weight"),
    "vision.layers.{i}.gate_up_bias": (_VL + "mlp.gate_proj.bias", _VL + "mlp.up_proj.bias"),
    "vision.layers.{i}.down": _VL + "mlp.down_proj.weight",
    "vision.layers.{i}.down_bias": _VL + "mlp.down_proj.bias",
    "vision.merger_norm": _V + "merger.ln_q.weight",
    "vision.merger_fc1": _V + "merger.mlp.0.weight",
    "vision.merger_fc1_bias": _V + "merger.mlp.0.bias",
    "vision.merger_fc2": _V + "merger.mlp.2.weight",
    "vision.merger_fc2_bias": _V + "merger.mlp.2.bias",
}
# transformers' Qwen2_5_VLVisionConfig defaults: a config.json lists only what differs
VISION_DEFAULTS: dict[str, Any] = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420,
                                       num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2,
                                       temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                                       fullatt_block_indexes=[7, 15, 23, 31])
HF_UNUSED = (r"visual\..*",)  # read by vision_tensor, not the text model
# transformers' Qwen2VLVideoProcessor defaults (Qwen2.5-VL's video processor): every frame kept unless the config
# samples; min_pixels / max_pixels at the top level override size
VIDEO_DEFAULTS: dict[str, Any] = dict(
    do_resize=True, size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, resample=3, do_rescale=True,
    rescale_factor=1 / 255, do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711], patch_size=14, temporal_patch_size=2, merge_size=2,
    do_sample_frames=False, fps=None, num_frames=None, min_frames=4, max_frames=768, cap_pixels_per_frame=False,
    max_video_tokens=128000)


def video_processor(config: dict) -> dict[str, Any]:
    """What the export resolves the checkpoint's video processor config over (export/vision_export.py):
    defaults, the sampling rule, the video token and the M-RoPE time step (tokens_per_second)."""
    token = config.get("video_token_id")
    if not isinstance(token, int):
        raise DecodertError("config.json: a qwen2_5_vl model needs an integer 'video_token_id' for video")
    tps = (config.get("vision_config") or {}).get("tokens_per_second", 4)
    return {"defaults": VIDEO_DEFAULTS, "sampling": "qwen2", "pixels_keys": True, "timestamps": False,
            "video_token_id": token, "tokens_per_second": int(tps)}


def sanitize(key: str) -> str | None:
    """transformers 5's names -> the Hub's (model.language_model.* -> model.*, model.visual.* -> visual.*)."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def text_config(config: dict) -> dict:
    """The Qwen2 text config (transformers 5's ``text_config``, else the top level), rope without 'mrope'."""
    text = {**config, **(config.get("text_config") or {})}
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
    text["rope_parameters"], text["rope_scaling"] = rope, None
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def spec_from_hf(config: dict, family: str = "qwen2_5_vl") -> ModelSpec:
    text = text_config(config)
    section = text["rope_parameters"].get("mrope_section")
    image_token = config.get("image_token_id")
    if not isinstance(image_token, int) or not isinstance(section, list):
        raise DecodertError(f"config.json: a {family} model needs an integer 'image_token_id' and "
                            "rope mrope_section")
    spec = qwen2.spec_from_hf(text)
    try:
        return dataclasses.replace(spec, family=family, images=ImageTokens(image_token),
                                   mrope=MRopeSpec(tuple(int(x) for x in section)))
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None


def vision_from_hf(config: dict) -> VisionSpec:
    v = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
    if v["hidden_act"] != "silu" or v["in_channels"] != 3:
        raise DecodertError(f"config.json: vision_config hidden_act '{v['hidden_act']}' / in_channels "
                            f"{v['in_channels']} is not supported (silu over RGB)")
    rope = v.get("rope_parameters") or {}
    patch, merge = int(v["patch_size"]), int(v["spatial_merge_size"])
    try:
        return VisionSpec(image_size=patch * merge, patch_size=patch, hidden_size=int(v["hidden_size"]),
                          intermediate_size=int(v["intermediate_size"]), num_layers=int(v["depth"]),
                          num_heads=int(v["num_heads"]), layer_norm_eps=1e-6, out_hidden=int(v["out_hidden_size"]),
                          scale_factor=merge, activation="silu", tower="qwen_vit",
                          temporal_patch_size=int(v["temporal_patch_size"]), window_size=int(v["window_size"]),
                          full_layers=tuple(int(i) for i in v["fullatt_block_indexes"]),
                          rope_theta=float(rope.get("rope_theta", 10000.0)))
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None
