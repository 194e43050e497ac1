"""Qwen3-VL (dense): a ViT with learned, resampled positions and deepstack mergers, and a Qwen3 text model with
interleaved M-RoPE whose first layers add the tower's earlier features at the image rows.

    config.json  model_type qwen3_vl: ``text_config`` a Qwen3 config (q/k norm) whose rope has mrope_section
                 (interleaved t, h, w pairs); ``vision_config`` (depth, hidden_size, num_heads, patch_size 16,
                 num_position_embeddings, deepstack_visual_indexes, gelu_pytorch_tanh); image_token_id
    weights      model.language_model.*, model.visual.*, lm_head.* (``sanitize``: as Qwen2.5-VL's)

What differs from Qwen2.5-VL (models/families/qwen2_5_vl.py), declared here and built by the shared recipes:
``MRopeSpec.interleaved`` (plugins/ops/mrope.py), ``ImageTokens.deepstack_layers`` (the prefill graph's deepstack_embeds
input, export/lowering/graph.py), and the ``qwen3_vit`` tower (export/lowering/vision_qwen.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decodert.errors import DecodertError
from decodert.models.families import qwen3
from decodert.models.families.qwen2_5_vl import sanitize, text_config
from decodert.models.spec import ImageTokens, ModelSpec, MRopeSpec
from decodert.models.vision import VisionSpec

__all__ = ["sanitize"]
MODEL_TYPES = ("qwen3_vl",)
TAGS = ('vision',)

HF_WEIGHTS = qwen3.HF_WEIGHTS
_V = "visual."
_VL = _V + "blocks.{i}."
_D = _V + "deepstack_merger_list.{i}."
VISION_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "vision.patch_embed": _V + "patch_embed.proj.weight",  # [C, 3, T, P, P] read as [C, 3 T P P]
    "vision.patch_embed_bias": _V + "patch_embed.proj.bias",
    "vision.pos_embed": _V + "pos_embed.weight",
    "vision.layers.{i}.ln1": _VL + "norm1.weight",
    "vision.layers.{i}.ln1_bias": _VL + "norm1.bias",
    "vision.layers.{i}.qkv": _VL + "attn.qkv.weight",
    "vision.layers.{i}.qkv_bias": _VL + "attn.qkv.bias",
    "vision.layers.{i}.o": _VL + "attn.proj.weight",
    "vision.layers.{i}.o_bias": _VL + "attn.proj.bias",
    "vision.layers.{i}.ln2": _VL + "norm2.weight",
    "vision.layers.{i}.ln2_bias": _VL + "norm2.bias",
    "vision.layers.{i}.fc1": _VL + "mlp.linear_fc1.weight",
    "vision.layers.{i}.fc1_bias": _VL + "mlp.linear_fc1.bias",
    "vision.layers.{i}.fc2": _VL + "mlp.linear_fc2.weight",
    "vision.layers.{i}.fc2_bias": _VL + "mlp.linear_fc2.bias",
    **{f"vision.merger_{n}": _V + f"merger.{k}" for n, k in (
        ("norm", "norm.weight"), ("norm_bias", "norm.bias"), ("fc1", "linear_fc1.weight"),
        ("fc1_bias", "linear_fc1.bias"), ("fc2", "linear_fc2.weight"), ("fc2_bias", "linear_fc2.bias"))},
    **{f"vision.deepstack.layers.{{i}}.{n}": _D + k for n, k in (
        ("norm", "norm.weight"), ("norm_bias", "norm.bias"), ("fc1", "linear_fc1.weight"),
        ("fc1_bias", "linear_fc1.bias"), ("fc2", "linear_fc2.weight"), ("fc2_bias", "linear_fc2.bias"))},
}
# transformers' Qwen3VLVisionConfig defaults: a config.json lists only what differs
VISION_DEFAULTS: dict[str, Any] = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh",
                                       intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                                       num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
HF_UNUSED = (r"visual\..*",)  # read by vision_tensor, not the text model
# transformers' Qwen3VLVideoProcessor defaults: frames sampled at 2 per second (4 .. 768), timestamps in the prompt
VIDEO_DEFAULTS: dict[str, Any] = dict(
    do_resize=True, size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, resample=3, do_rescale=True,
    rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], patch_size=16,
    temporal_patch_size=2, merge_size=2, do_sample_frames=True, fps=2, num_frames=None, min_frames=4, max_frames=768,
    cap_pixels_per_frame=False, max_video_tokens=768)


def video_processor(config: dict) -> dict[str, Any]:
    """As Qwen2.5-VL's (models/families/qwen2_5_vl.py), with Qwen3-VL's sampling and timestamped slices."""
    token = config.get("video_token_id")
    if not isinstance(token, int):
        raise DecodertError("config.json: a qwen3_vl model needs an integer 'video_token_id' for video")
    return {"defaults": VIDEO_DEFAULTS, "sampling": "qwen3", "pixels_keys": False, "timestamps": True,
            "video_token_id": token, "tokens_per_second": None}


def spec_from_hf(config: dict) -> ModelSpec:
    text = text_config(config)
    section = text["rope_parameters"].get("mrope_section")
    image_token = config.get("image_token_id")
    if not isinstance(image_token, int) or not isinstance(section, list):
        raise DecodertError("config.json: a qwen3_vl model needs an integer 'image_token_id' and rope mrope_section")
    deep = (config.get("vision_config") or {}).get("deepstack_visual_indexes", VISION_DEFAULTS["deepstack_visual_indexes"])
    spec = qwen3.spec_from_hf(text)
    try:
        return dataclasses.replace(spec, family="qwen3_vl", images=ImageTokens(image_token, deepstack_layers=len(deep)),
                                   mrope=MRopeSpec(tuple(int(x) for x in section), interleaved=True))
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None


def vision_from_hf(config: dict) -> VisionSpec:
    v = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
    return tower_from_hf(v, tuple(int(i) for i in v["deepstack_visual_indexes"]))


def tower_from_hf(v: dict, deepstack: tuple[int, ...]) -> VisionSpec:
    """The ``qwen3_vit`` tower of a complete vision_config ``v`` (defaults applied) whose layers ``deepstack`` feed
    the text model (Qwen3.5's tower has none: models/families/qwen3_5.py)."""
    if v["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_new") or v["in_channels"] != 3:
        raise DecodertError(f"config.json: vision_config hidden_act '{v['hidden_act']}' / in_channels "
                            f"{v['in_channels']} is not supported (gelu_pytorch_tanh over RGB)")
    side = round(int(v["num_position_embeddings"]) ** 0.5)
    if side * side != int(v["num_position_embeddings"]):
        raise DecodertError(f"config.json: vision_config num_position_embeddings {v['num_position_embeddings']} "
                            "is not a square grid")
    rope = v.get("rope_parameters") or {}
    patch, merge = int(v["patch_size"]), int(v["spatial_merge_size"])
    try:
        return VisionSpec(image_size=patch * merge, patch_size=patch, hidden_size=int(v["hidden_size"]),
                          intermediate_size=int(v["intermediate_size"]), num_layers=int(v["depth"]),
                          num_heads=int(v["num_heads"]), layer_norm_eps=1e-6, out_hidden=int(v["out_hidden_size"]),
                          scale_factor=merge, tower="qwen3_vit", temporal_patch_size=int(v["temporal_patch_size"]),
                          full_layers=tuple(range(int(v["depth"]))), rope_theta=float(rope.get("rope_theta", 10000.0)),
                          num_positions=int(v["num_position_embeddings"]), deepstack=deepstack)
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None
