"""Qwen2.5-VL / Qwen3-VL video preprocessing in numpy + Pillow, as transformers' Qwen2VLVideoProcessor /
Qwen3VLVideoProcessor do it for the same frames (the settings are the checkpoint's video processor config,
resolved at export: export/vision_export.py ``video_settings``):

    frames        what the caller passed, [T, H, W, 3] uint8, with ``fps`` = the rate they were taken at
                  (None: transformers' assumption for frames without metadata, 24)
    sampling      only where the config has do_sample_frames (Qwen3-VL's default, not Qwen2.5-VL's): the
                  processor's own rule over the given frames with that fps (``sample``); else every frame
    resize        one size for the whole clip: smart_resize (Qwen2: per frame; Qwen3: frames x pixels), then
                  torchvision's resize of a uint8 tensor on the CPU: torch's native antialiased uint8 kernel
                  (int16 fixed-point weights, each pass rounded to uint8), reproduced exactly
    normalise     (x - mean / rescale) / (std / rescale) in float32 (transformers' fused rescale + normalise)
    patches       frames padded to a multiple of temporal_patch_size with the last one; each temporal group
                  of frames (2) is one grid slice: qwen_preprocess.patches, as an image's rows but with distinct
                  frames. The towers attend within a slice only (cu_seqlens per t), so each slice is encoded
                  by itself and the rows concatenated are the video's.

The prompt: Qwen2.5-VL writes ``<|video_pad|>`` x (t * rows * cols) where the template put one; Qwen3-VL
writes per slice ``<{time:.1f} seconds><|vision_start|>`` + ``<|video_pad|>`` x (rows * cols) +
``<|vision_end|>`` in place of the template's ``<|vision_start|><|video_pad|><|vision_end|>``, the time the
mean of the slice's first and last frame times (Qwen3VLProcessor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from decodert.errors import DecodertError
from decodert.models.vision import VisionSpec
from decodert.runtime.vision import qwen_preprocess as qp

VIDEO_PAD = "<|video_pad|>"
START, END = "<|vision_start|>", "<|vision_end|>"
DEFAULT_FPS = 24.0  # transformers' VideoMetadata assumption for frames that come without a rate


@dataclass(frozen=True)
class Timing:
    keep: np.ndarray  # [F] the given frames the processor keeps
    interval: float  # Qwen2.5-VL: the M-RoPE temporal step between slices (tokens_per_second * seconds per slice)
    times: list[float]  # each slice's time in seconds (Qwen3-VL's prompt timestamps)


def timing(total: int, fps: float | None, s: Mapping[str, Any]) -> Timing:
    """Which frames, and the slices' timing (no pixels read: the prompt of a cached video needs only this)."""
    keep = sample(total, fps, s)
    tp = int(s["temporal_patch_size"])
    rate = fps or DEFAULT_FPS
    sampled = rate if fps is None else len(keep) / total * fps  # VideoMetadata.sampled_fps
    interval = float(np.float32(tp / sampled) * np.float32(s.get("tokens_per_second") or 1))
    seconds = [int(i) / rate for i in keep]
    seconds += seconds[-1:] * (-len(seconds) % tp)
    return Timing(keep, interval, [(seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp)])


def sample(total: int, fps: float | None, s: Mapping[str, Any]) -> np.ndarray:
    """The indices of the given frames the processor keeps (its ``sample_frames`` with the metadata
    ``total_num_frames=total, fps=fps``); every frame unless the config samples."""
    if not s["do_sample_frames"]:
        return np.arange(total)
    tp, target, count = int(s["temporal_patch_size"]), s.get("fps"), s.get("num_frames")
    lo, hi = int(s["min_frames"]), int(s["max_frames"])
    if s["sampling"] == "qwen3":  # Qwen3VLVideoProcessor.sample_frames
        if count is None and target is not None:
            count = min(max(int(total / (fps or DEFAULT_FPS) * target), lo), hi, total)
        if count is None:
            count = min(max(total, lo), hi)
        return np.linspace(0, total - 1, int(count)).round().astype(np.int64)
    if count is not None:  # Qwen2VLVideoProcessor.sample_frames
        count = round(count / tp) * tp
    elif target is not None:
        if fps is None:
            raise DecodertError("this model samples video frames by time: give the video's 'fps'")
        top = math.floor(min(hi, total) / tp) * tp
        count = math.floor(min(max(total / fps * target, lo), top, total) / tp) * tp
    if count is None:
        return np.arange(total)
    if count > total or count <= 0:
        raise DecodertError(f"a video of {total} frames cannot be sampled to {count} frames")
    step = total / count  # torch.arange(0, total, step).int(): float64 steps, float32 values, truncated
    return (np.arange(math.ceil(total / step)) * step).astype(np.float32).astype(np.int64)


def frame_size(frames: int, height: int, width: int, s: Mapping[str, Any]) -> tuple[int, int]:
    """The one (height, width) every frame is resized to (the processor's ``resize``)."""
    factor, tp = int(s["patch_size"]) * int(s["merge_size"]), int(s["temporal_patch_size"])
    lo, hi = int(s["min_pixels"]), int(s["max_pixels"])
    if s["sampling"] == "qwen3":
        if frames < tp:
            raise DecodertError(f"a video needs at least {tp} frames for this model, got {frames}")
        if s.get("cap_pixels_per_frame"):
            hi = max(min(int(s["max_video_tokens"]) * factor * factor, hi // frames), int(lo * 1.05)) * frames
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        return _smart_resize3(frames, height, width, tp, factor, lo, hi)
    if s.get("cap_pixels_per_frame"):
        total = int(int(s["max_video_tokens"]) * factor * factor * 0.9)
        hi = max(min(hi, total * tp // frames), int(lo * 1.05))
    return qp.smart_resize(height, width, factor, lo, hi)


def _smart_resize3(t: int, height: int, width: int, tf: int, factor: int, lo: int, hi: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: the pixel bounds apply to frames x height x width."""
    if max(height, width) / min(height, width) > 200:
        raise DecodertError(f"video aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar, w_bar, t_bar = round(height / factor) * factor, round(width / factor) * factor, round(t / tf) * tf
    if t_bar * h_bar * w_bar > hi:
        beta = math.sqrt(t * height * width / hi)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < lo:
        beta = math.sqrt(lo / (t * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize(frame: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8 as torchvision resizes a uint8 tensor on the CPU: bicubic (3)
    and bilinear (2, on AVX2 / arm64 CPUs) through torch's native uint8 antialiased kernel, reproduced exactly
    (``_filter_axis``); other filters through Pillow (an approximation of torchvision's float path)."""
    from PIL import Image

    if frame.shape[:2] == (height, width):
        return frame
    if resample not in _FILTERS:
        return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling(resample)))
    x = frame
    if x.shape[1] != width:  # horizontal first, each pass rounded to uint8, as torch does
        x = _filter_axis(x, width, 1, resample)
    if x.shape[0] != height:
        x = _filter_axis(x, height, 0, resample)
    return x


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


_FILTERS = {2: (1.0, lambda x: np.clip(1 - np.abs(x), 0, None)), 3: (2.0, _keys_cubic)}  # resample -> (support, filter)


def _filter_axis(x: np.ndarray, size: int, axis: int, resample: int) -> np.ndarray:
    """One antialiased pass of torch's uint8 kernel (UpSampleKernel's _compute_index_ranges_int16_weights):
    PIL-style weights in float64 around each output's centre, normalised, scaled to int16 at the largest precision
    (< 22 bits) the biggest weight allows; each output an integer dot product plus half a unit, shifted, clamped."""
    n_in = x.shape[axis]
    half, fn = _FILTERS[resample]
    scale = n_in / size
    support = half * scale if scale >= 1 else half
    taps = int(math.ceil(support)) * 2 + 1
    inv = 1.0 / scale if scale >= 1 else 1.0
    weights = np.zeros((size, taps))
    lo = np.zeros(size, np.int64)
    for i in range(size):
        center = scale * (i + 0.5)
        lo[i] = max(int(center - support + 0.5), 0)
        count = min(max(min(int(center + support + 0.5), n_in) - int(lo[i]), 0), taps)
        w = fn((np.arange(count) + lo[i] - center + 0.5) * inv)
        total = sum(w.tolist())  # summed in order, as the C loop does
        weights[i, :count] = w / total if total != 0 else w
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < 1 << 15:
        precision += 1
    scaled = weights * (1 << precision)
    ints = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    src = np.ascontiguousarray(np.moveaxis(x, axis, 0), np.int32)  # int32 sums, as torch's (255 x 2^15 x taps fits)
    shape = (size,) + (1,) * (src.ndim - 1)
    acc = np.full((size, *src.shape[1:]), 1 << (precision - 1), np.int32)
    for j in range(taps):  # taps past an output's count weigh 0: any row in range serves
        acc += src[np.minimum(lo + j, n_in - 1)] * ints[:, j].reshape(shape)
    return np.ascontiguousarray(np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), 0, axis))


def normalise(frames: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
    """[F, H, W, 3] uint8 -> [F, 3, H, W] float32, as transformers' fused rescale + normalise."""
    x = frames.astype(np.float32).transpose(0, 3, 1, 2)
    if s["do_normalize"]:
        scale = np.float32(1.0 / float(s["rescale_factor"])) if s["do_rescale"] else np.float32(1)
        mean = (np.asarray(s["image_mean"], np.float32) * scale)[:, None, None]
        std = (np.asarray(s["image_std"], np.float32) * scale)[:, None, None]
        return np.ascontiguousarray((x - mean) / std)
    if s["do_rescale"]:
        x = x * np.float32(s["rescale_factor"])
    return np.ascontiguousarray(x)


def preprocess(frames: np.ndarray, keep: np.ndarray, s: Mapping[str, Any], v: VisionSpec) -> list[qp.Patches]:
    """[T, H, W, 3] uint8 frames, the kept indices -> the slices vision.onnx encodes, one per temporal group."""
    frames = frames[keep]
    p, m, tp = int(s["patch_size"]), int(s["merge_size"]), int(s["temporal_patch_size"])
    h, w = frames.shape[1:3]
    if s["do_resize"]:
        h, w = frame_size(len(frames), h, w, s)
    if h % (p * m) or w % (p * m):
        raise DecodertError(f"video frames {w}x{h} are not a multiple of {p * m} pixels (do_resize is off)")
    x = normalise(np.stack([resize(f, h, w, int(s["resample"])) for f in frames]), s)
    if pad := -len(x) % tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    return [qp.patches(x[i : i + tp], s, v) for i in range(0, len(x), tp)]


def prompt(rows: int, cols: int, times: list[float], s: Mapping[str, Any]) -> str:
    """What one video placeholder (``placeholder``) becomes: its slices of rows x cols tokens."""
    pads = VIDEO_PAD * (rows * cols)
    if s.get("timestamps"):
        return "".join(f"<{t:.1f} seconds>{START}{pads}{END}" for t in times)
    return pads * len(times)


def placeholder(s: Mapping[str, Any]) -> str:
    """The template's text for one video part that ``prompt`` replaces: Qwen3-VL's whole
    ``<|vision_start|><|video_pad|><|vision_end|>`` (each slice has its own), else the pad."""
    return START + VIDEO_PAD + END if s.get("timestamps") else VIDEO_PAD
