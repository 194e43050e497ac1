"""Qwen2.5-VL image preprocessing in numpy + Pillow, as transformers' Qwen2VLImageProcessorPil does it (the
settings are the checkpoint's preprocessor_config.json, resolved at export: export/vision_export.py):

    smart_resize: both sides to multiples of patch * merge (rounded), then scaled so that
                  min_pixels <= h * w <= max_pixels, the aspect kept; Pillow resize (bicubic by default)
    rescale, normalise (preprocess.normalise), channels first
    patches:      [gh/m, m, p, gw/m, m, p] -> rows (unit, mh, mw) of (channel, frame, py, px), the frame
                  repeated temporal_patch_size times: pixel_values [gh*gw, 3 T p p]
    window order: merged units regrouped by window (window_size / m / p units a side), as
                  transformers' get_vision_window_index; vision.onnx takes the rows in that order and
                  ``restore`` puts its output rows back

and the prompt: the chat template's ``<|image_pad|>`` repeated (gh/m) * (gw/m) times (Qwen2_5_VLProcessor).
Qwen3-VL: the same processor (16-px patches, no windows) plus the bilinear taps of its learned positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from decodert.errors import DecodertError
from decodert.models.vision import VisionSpec
from decodert.runtime.vision.preprocess import normalise

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class Patches:
    pixels: np.ndarray  # [P, 3 T p p] float32, window order
    positions: np.ndarray  # [P, 2] int64 (row, column) in the patch grid
    windows: np.ndarray  # [P] int64
    restore: np.ndarray  # [P / m^2] output row (window order) of each merged token in image order
    rows: int  # merged tokens per column: gh / m
    cols: int  # gw / m
    taps: tuple[np.ndarray, np.ndarray] | None = None  # qwen3_vit: pos_indices [P, 4] int64, pos_weights [P, 4]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize (Qwen2-VL)."""
    if max(height, width) / min(height, width) > 200:
        raise DecodertError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(rgb: np.ndarray, settings: Mapping[str, Any], v: VisionSpec) -> Patches:
    """RGB uint8 [H, W, 3] -> the patch rows vision.onnx takes."""
    from PIL import Image

    p, m, t = int(settings["patch_size"]), int(settings["merge_size"]), int(settings["temporal_patch_size"])
    img = Image.fromarray(rgb)
    if settings["do_resize"]:
        h, w = smart_resize(img.height, img.width, p * m, int(settings["min_pixels"]), int(settings["max_pixels"]))
        img = img.resize((w, h), Image.Resampling(int(settings["resample"])))
    if img.height % (p * m) or img.width % (p * m):
        raise DecodertError(f"image {img.width}x{img.height} is not a multiple of {p * m} pixels (do_resize is off)")
    x = normalise(np.asarray(img), settings)  # [3, H, W]
    return patches(np.broadcast_to(x[None], (t, *x.shape)), settings, v)  # the frame repeated t times


def patches(frames: np.ndarray, settings: Mapping[str, Any], v: VisionSpec) -> Patches:
    """One temporal patch: [t, 3, H, W] normalised frames (an image repeated, or t frames of a video) -> the
    patch rows vision.onnx takes (rows of (channel, frame, py, px))."""
    p, m, t = int(settings["patch_size"]), int(settings["merge_size"]), frames.shape[0]
    gh, gw = frames.shape[2] // p, frames.shape[3] // p
    x = frames.reshape(t, 3, gh // m, m, p, gw // m, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)  # (uh, uw, mh, mw, C, T, py, px)
    x = x.reshape(gh * gw, 3 * t * p * p)
    order, unit_window = window_order(gh // m, gw // m, v.window_size // m // p if v.window_size else 0)
    unit = m * m
    rows = (order[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)  # patch rows in window order
    uh, uw = order // (gw // m), order % (gw // m)
    mh, mw = np.arange(unit) // m, np.arange(unit) % m
    pos = np.stack([(uh[:, None] * m + mh).reshape(-1), (uw[:, None] * m + mw).reshape(-1)], axis=1)
    taps = bilinear_taps(pos, gh, gw, int(round(v.num_positions ** 0.5))) if v.num_positions else None
    return Patches(np.ascontiguousarray(x[rows], np.float32), pos.astype(np.int64),
                   np.repeat(unit_window, unit).astype(np.int64), np.argsort(order), gh // m, gw // m, taps)


def bilinear_taps(pos: np.ndarray, gh: int, gw: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned positions resampled to a gh x gw grid (F.interpolate bilinear, align_corners, as
    transformers' get_vision_interpolation_indices_and_weights): per patch 4 rows of the side x side table
    and their weights, float32 like torch's."""
    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None).astype(np.float32)
        return taps, weights

    (ht, hw), (wt, ww) = axis(pos[:, 0], gh), axis(pos[:, 1], gw)
    return (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4), (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)


def window_order(rows: int, cols: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Merged units (row-major index) regrouped window by window (``side`` units a side; 0: one window)
    -> (unit index in window order [U], the window of each [U])."""
    index = np.arange(rows * cols).reshape(rows, cols)
    if side <= 0:
        return index.reshape(-1), np.zeros(rows * cols, np.int64)
    wr, wc = np.arange(rows) // side, np.arange(cols) // side
    window = (wr[:, None] * (-(-cols // side)) + wc[None, :]).reshape(-1)
    order = np.lexsort((index.reshape(-1), window))  # by window, then row-major inside it
    return order, window[order]


def image_prompt(rows: int, cols: int) -> str:
    return IMAGE_PAD * (rows * cols)
