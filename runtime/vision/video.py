"""One video from what a caller passes: its frames, already decoded or as images (no video decoding here).

    {"type": "video", "video": frames, "fps": 2.0}

``frames``: a [T, H, W, 3] uint8 array, or a list of frames each a path, bytes, a PIL image, an HxWx3 uint8
array or a data URL (runtime/vision/images.py decodes each under the image limits). All frames of a video
share one size. ``fps``: the rate the frames were taken at (optional; the model's video processor uses it to
sample frames and to time them: runtime/vision/qwen_video.py). Every refusal is a one-line DecodertError
naming the video: no frames, more than ``max_frames`` frames in the request, more than
``max_video_pixels`` pixels over all of its frames, frames of different sizes, an fps outside [0.001, 1000].
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.vision.images import ImageLimits, load_image


MIN_FPS, MAX_FPS = 1e-3, 1e3  # a frame every 1000 s .. 1000 frames a second


@dataclass(frozen=True, eq=False)
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8
    fps: float | None = None


def load_video(value: Any, fps: Any, what: str, limits: ImageLimits, frames_before: int = 0,
               pixels_before: int = 0) -> Video:
    """``value`` -> a Video; ``frames_before`` / ``pixels_before``: what earlier videos of the request used."""
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps)
                            or not MIN_FPS <= fps <= MAX_FPS):  # 1e-300 overflowed the frame count (a 500)
        raise DecodertError(f"{what}: fps must be a number between {MIN_FPS:g} and {MAX_FPS:g}, got {fps!r:.40}")
    if isinstance(value, np.ndarray) and value.ndim == 4:
        if value.shape[-1] != 3 or value.dtype != np.uint8 or 0 in value.shape:
            raise DecodertError(f"{what}: an array must be TxHxWx3 uint8 RGB, got {value.dtype} {list(value.shape)}")
        _check(len(value), value.shape[1] * value.shape[2], what, limits, frames_before, pixels_before)
        return Video(np.ascontiguousarray(value), None if fps is None else float(fps))
    if isinstance(value, (str, bytes, np.ndarray)) or not hasattr(value, "__len__") or len(value) == 0:
        raise DecodertError(f"{what}: a video must be a non-empty list of frames (paths, bytes, PIL images, "
                            "HxWx3 arrays, data URLs) or a TxHxWx3 uint8 array")
    _check(len(value), 0, what, limits, frames_before, pixels_before)
    frames: list[np.ndarray] = []
    pixels = pixels_before
    for k, item in enumerate(value):
        frame = load_image(item, f"{what} frame {k}", limits)
        if frames and frame.shape != frames[0].shape:
            raise DecodertError(f"{what} frame {k} is {frame.shape[1]}x{frame.shape[0]}; the frames of a video "
                                f"must share one size ({frames[0].shape[1]}x{frames[0].shape[0]})")
        pixels += frame.shape[0] * frame.shape[1]
        if pixels > limits.max_video_pixels:
            raise DecodertError(f"{what}: the request's video frames have over {limits.max_video_pixels} pixels "
                                "in all (the limit)")
        frames.append(frame)
    return Video(np.stack(frames), None if fps is None else float(fps))


def _check(count: int, pixels: int, what: str, limits: ImageLimits, frames_before: int, pixels_before: int) -> None:
    if frames_before + count > limits.max_frames:
        raise DecodertError(f"{what}: too many video frames: the limit is {limits.max_frames} per request")
    if pixels_before + count * pixels > limits.max_video_pixels:
        raise DecodertError(f"{what}: the request's video frames have over {limits.max_video_pixels} pixels "
                            "in all (the limit)")
