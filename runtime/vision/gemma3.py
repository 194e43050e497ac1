"""Gemma 3 image preprocessing in numpy + Pillow, as transformers' Gemma3ImageProcessorPil does it with
pan-and-scan off (the settings are the checkpoint's, resolved at export: models/families/gemma3.py):

    resize to size.height x size.width (the tower's image_size) with the configured resample,
    rescale (x rescale_factor, float64 -> float32), normalise ((x - mean) / std), channels first: one tile

and the prompt text that replaces each ``boi_token`` the chat template places (Gemma3Processor):
``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x image_seq_len + ``<end_of_image>\\n\\n``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from decodert.runtime.vision.preprocess import Tiles, normalise


def placeholder(settings: Mapping[str, Any]) -> str:
    """What the chat template writes for one image part."""
    return str(settings["boi_token"])


def image_token(settings: Mapping[str, Any]) -> str:
    return str(settings["image_token"])


def preprocess(rgb: np.ndarray, settings: Mapping[str, Any]) -> Tiles:
    """RGB uint8 [H, W, 3] -> the one tile [1, 3, S, S] the vision graph takes."""
    from PIL import Image

    size = settings["size"]
    img = Image.fromarray(rgb).resize((int(size["width"]), int(size["height"])),
                                      Image.Resampling(int(settings["resample"])))
    return Tiles(normalise(np.asarray(img), settings)[None], 0, 0)


def prompt(tiles: Tiles, settings: Mapping[str, Any]) -> str:
    """The text Gemma3Processor puts in place of one ``boi_token``."""
    image = image_token(settings) * int(settings["image_seq_len"])
    return f"\n\n{settings['boi_token']}{image}{settings['eoi_token']}\n\n"
