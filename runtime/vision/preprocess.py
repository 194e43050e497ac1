"""Idefics3 / SmolVLM image preprocessing in numpy + Pillow, as transformers' PIL image processor does
it (the settings are the checkpoint's preprocessor_config.json, resolved at export: export/vision_export.py):

    resize so the longest edge is size.longest_edge (odd sides rounded up to even; at most 4096)
    splitting: resize up to multiples of the tile side S, crop rows x cols tiles of S x S, then the whole
               image resized to S x S (the global tile) last; no splitting: the image resized to S x S
    rescale (x rescale_factor, float64 -> float32), normalise ((x - mean) / std), channels first

and the prompt text that replaces each ``<image>`` (Idefics3Processor): per tile
``<fake_token_around_image><row_r_col_c>`` + ``<image>`` x image_seq_len, a newline after each row,
then ``\n<fake_token_around_image><global-img>`` + ``<image>`` x image_seq_len + ``<fake_token_around_image>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
MAX_SIDE = 4096


@dataclass(frozen=True)
class Tiles:
    pixels: np.ndarray  # [n_tiles, 3, S, S] float32
    rows: int  # 0 when the image is not split
    cols: int


def preprocess(rgb: np.ndarray, settings: Mapping[str, Any]) -> Tiles:
    """RGB uint8 [H, W, 3] -> the tiles the vision graph takes."""
    from PIL import Image

    img = Image.fromarray(rgb)
    resample = Image.Resampling(int(settings["resample"]))
    tile = int(settings["max_image_size"]["longest_edge"])
    if settings["do_resize"]:
        img = img.resize(_longest_edge(img.height, img.width, int(settings["size"]["longest_edge"]))[::-1], resample)
    rows = cols = 0
    if settings["do_image_splitting"]:
        h, w = _multiples(img.height, img.width, tile)
        img = img.resize((w, h), resample)
        if h > tile or w > tile:
            rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
            frames = [img.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                      for r in range(rows) for c in range(cols)]
            frames.append(img.resize((tile, tile), resample))
        else:
            frames = [img]
    else:
        frames = [img.resize((tile, tile), resample)]
    return Tiles(np.stack([normalise(np.asarray(f), settings) for f in frames]), rows, cols)


def image_prompt(tiles: Tiles, seq_len: int) -> str:
    """The text Idefics3Processor puts in place of one ``<image>``."""
    image = IMAGE * seq_len
    if tiles.rows == 0 and tiles.cols == 0:
        return f"{FAKE}{GLOBAL}{image}{FAKE}"
    text = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{image}" for c in range(tiles.cols)) + "\n"
                   for r in range(tiles.rows))
    return text + f"\n{FAKE}{GLOBAL}{image}{FAKE}"


def placeholder(settings: Mapping[str, Any]) -> str:
    """What the chat template writes for one image part."""
    return IMAGE


def image_token(settings: Mapping[str, Any]) -> str:
    return IMAGE


def prompt(tiles: Tiles, settings: Mapping[str, Any]) -> str:
    return image_prompt(tiles, int(settings["image_seq_len"]))


def normalise(a: np.ndarray, settings: Mapping[str, Any]) -> np.ndarray:
    """[S, S, 3] uint8 -> [3, S, S] float32, rescaled and normalised as transformers does (float64 product)."""
    x = a.astype(np.float32)
    if settings["do_rescale"]:
        x = (a.astype(np.float64) * float(settings["rescale_factor"])).astype(np.float32)
    if settings["do_normalize"]:
        mean = np.array(settings["image_mean"], np.float32)
        std = np.array(settings["image_std"], np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _longest_edge(h: int, w: int, max_len: int) -> tuple[int, int]:
    """(height, width) with the longest edge ``max_len`` (the other rounded up to even), then under 4096."""
    aspect = w / h
    if w >= h:
        w = max_len
        h = int(w / aspect)
        h += h % 2
    else:
        h = max_len
        w = int(h * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    aspect = w / h
    if w >= h and w > MAX_SIDE:
        w, h = MAX_SIDE, int(MAX_SIDE / aspect)
    elif h > w and h > MAX_SIDE:
        h, w = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(h, 1), max(w, 1)


def _multiples(h: int, w: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both sides up to multiples of ``tile``, the aspect kept first."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w
