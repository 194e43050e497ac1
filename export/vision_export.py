"""The vision half of an export: vision.onnx (over the vision weights already in weights.bin) and the
manifest's ``vision`` record, with the checkpoint's image processor settings resolved once here so the
runtime needs neither transformers nor the checkpoint folder (runtime/vision/preprocess.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from decodert.errors import DecodertError
from decodert.artifact.manifest import GraphRecord, VisionRecord, from_json
from decodert.export.lowering.lowering import Lowering
from decodert.export.lowering.vision_graph import build_vision_graph, vision_contract
from decodert.models.vision import VisionSpec

VISION_FILE = "vision.onnx"
# transformers' Idefics3ImageProcessor defaults: a preprocessor_config.json lists only what differs
PROCESSOR_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size={"longest_edge": 4 * 364}, resample=1, do_rescale=True,
    rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    do_image_splitting=True, max_image_size={"longest_edge": 364})
_KEYS = tuple(PROCESSOR_DEFAULTS)


def vision_of(ckpt: Any) -> VisionSpec | None:
    """The checkpoint's vision tower, when its family declares one (HF folders only)."""
    read = ckpt.family.vision_from_hf
    return read(ckpt.config) if read is not None and getattr(ckpt, "config", None) is not None else None


# transformers' Qwen2VLImageProcessor defaults (Qwen2.5-VL's): size = {shortest_edge: min_pixels, longest_edge:
# max_pixels}; min_pixels / max_pixels at the top level override them
QWEN_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, resample=3,
    do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711], patch_size=14, temporal_patch_size=2, merge_size=2)


def qwen_settings(folder: Path, vision: VisionSpec) -> dict[str, Any]:
    """Qwen2-VL's image processor settings, checked against the tower."""
    raw = _json(folder / "preprocessor_config.json")
    settings = {k: raw.get(k, v) for k, v in QWEN_DEFAULTS.items()}
    size = dict(settings["size"] or {})
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if raw.get(key) is not None:
            size[edge] = raw[key]
    if not all(isinstance(size.get(k), int) and size[k] > 0 for k in ("shortest_edge", "longest_edge")):
        raise DecodertError(f"{folder}: preprocessor_config.json needs min_pixels/max_pixels (size.shortest_edge/"
                            "longest_edge) as positive integers")
    tower = (vision.patch_size, vision.temporal_patch_size, vision.scale_factor)
    if (settings["patch_size"], settings["temporal_patch_size"], settings["merge_size"]) != tower:
        raise DecodertError(f"{folder}: preprocessor patch_size/temporal_patch_size/merge_size differ from the "
                            f"vision tower's {list(tower)}")
    if settings["resample"] not in range(6):
        raise DecodertError(f"{folder}: preprocessor_config.json resample {settings['resample']!r} is not supported")
    return {**settings, "size": size, "min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}


def processor_settings(folder: Path, vision: VisionSpec) -> dict[str, Any]:
    """preprocessor_config.json (+ processor_config.json's image_seq_len) over the defaults, checked."""
    if vision.tower in ("qwen_vit", "qwen3_vit"):
        return qwen_settings(folder, vision)
    raw = _json(folder / "preprocessor_config.json")
    settings = {k: raw.get(k, v) for k, v in PROCESSOR_DEFAULTS.items()}
    seq_len = _json(folder / "processor_config.json").get("image_seq_len", vision.tokens_per_tile)
    tile = (settings["max_image_size"] or {}).get("longest_edge")
    if tile != vision.image_size:
        raise DecodertError(f"{folder}: preprocessor max_image_size {tile} differs from the vision tower's "
                            f"image_size {vision.image_size}")
    if seq_len != vision.tokens_per_tile:
        raise DecodertError(f"{folder}: processor image_seq_len {seq_len} differs from the {vision.tokens_per_tile} "
                            "tokens the vision tower makes per tile")
    if not isinstance((settings["size"] or {}).get("longest_edge"), int) or settings["resample"] not in range(6):
        raise DecodertError(f"{folder}: preprocessor_config.json size.longest_edge / resample is not supported")
    return {**settings, "image_seq_len": seq_len}


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DecodertError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise DecodertError(f"{path}: expected a JSON object")
    return data


def write_vision(ckpt: Any, vision: VisionSpec, weights: dict[str, onnx.TensorProto], dtype: str, folder: Path,
                 ir_version: int, low: type[Lowering]) -> VisionRecord:
    """Write vision.onnx into ``folder`` (checked) -> the manifest's ``vision`` record; ``low``: the target's
    lowering (its vision encoder attention)."""
    path = folder / VISION_FILE
    onnx.save_model(build_vision_graph(vision, dtype, weights, ir_version, low), path)
    onnx.checker.check_model(str(path), full_check=True)
    graph = from_json(GraphRecord, {"file": VISION_FILE, **vision_contract(vision, dtype)}, "vision.graph")
    processor = family_settings(ckpt, vision)
    declared = ckpt.family.video_processor
    if declared is not None:  # families without one take no video (runtime/vision/encoder.py refuses it)
        processor["video"] = video_settings(Path(ckpt.source), declared(ckpt.config), vision)
    return VisionRecord(graph=graph, spec=vision.to_dict(), processor=processor)


def video_settings(folder: Path, declared: dict[str, Any], vision: VisionSpec) -> dict[str, Any]:
    """The checkpoint's video processor config (processor_config.json's video_processor, else
    video_preprocessor_config.json, else preprocessor_config.json: transformers' order) over the family's
    defaults, checked against the tower (runtime/vision/qwen_video.py reads it)."""
    nested = _json(folder / "processor_config.json").get("video_processor")
    raw = nested if isinstance(nested, dict) else (_json(folder / "video_preprocessor_config.json")
                                                   or _json(folder / "preprocessor_config.json"))
    defaults = declared["defaults"]
    settings = {k: raw.get(k, v) for k, v in defaults.items()}
    size = dict(settings["size"] or {})
    if declared["pixels_keys"]:  # Qwen2VLVideoProcessor: min_pixels / max_pixels override size
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if raw.get(key) is not None:
                size[edge] = raw[key]
    where = f"{folder}: the video processor config"
    if not all(isinstance(size.get(k), int) and size[k] > 0 for k in ("shortest_edge", "longest_edge")):
        raise DecodertError(f"{where} needs size.shortest_edge/longest_edge as positive integers")
    tower = (vision.patch_size, vision.temporal_patch_size, vision.scale_factor)
    if (settings["patch_size"], settings["temporal_patch_size"], settings["merge_size"]) != tower:
        raise DecodertError(f"{where}: patch_size/temporal_patch_size/merge_size differ from the tower's {list(tower)}")
    if settings["resample"] not in range(6):
        raise DecodertError(f"{where}: resample {settings['resample']!r} is not supported")
    if settings["fps"] is not None and settings["num_frames"] is not None:
        raise DecodertError(f"{where}: fps and num_frames are mutually exclusive")
    return {**settings, "size": size, "min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"],
            **{k: declared[k] for k in ("sampling", "timestamps", "video_token_id", "tokens_per_second")}}


def family_settings(ckpt: Any, vision: VisionSpec) -> dict[str, Any]:
    """The family's ``image_processor(preprocessor, processor, tokenizer_config, vision)`` over the folder's
    JSON files, when it declares one (its settings name their ``kind``: runtime/vision/encoder.py), else Idefics3's."""
    folder = Path(ckpt.source)
    read = ckpt.family.image_processor
    if read is None:
        return processor_settings(folder, vision)
    try:
        return read(*(_json(folder / f) for f in ("preprocessor_config.json", "processor_config.json",
                                                   "tokenizer_config.json")), vision)
    except DecodertError as e:
        raise DecodertError(f"{folder}: {e}") from None
