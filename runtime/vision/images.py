"""One image from what a caller passes (a path, bytes, a PIL image, an HxWx3 uint8 array, a data URL),
decoded with Pillow under limits, as an RGB uint8 array [H, W, 3].

Every refusal is a one-line DecodertError naming the image: bytes over ``max_bytes``, more than
``max_pixels`` pixels (checked from the header before decoding: a decompression bomb never expands),
data Pillow cannot decode, an array of another shape or dtype, a remote URL unless allowed.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20  # encoded size
    max_pixels: int = 40_000_000  # width x height, read from the header before decoding
    max_images: int = 8  # per request / conversation turn set
    max_frames: int = 256  # video frames per request (runtime/vision/video.py)
    max_video_pixels: int = 100_000_000  # width x height summed over a request's video frames


DEFAULT_LIMITS = ImageLimits()


def load_image(value: Any, what: str = "image", limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """``value`` -> RGB uint8 [H, W, 3]; DecodertError (one line, naming ``what``) when it is refused."""
    from PIL import Image

    if isinstance(value, np.ndarray):
        return _from_array(value, what, limits)
    if isinstance(value, Image.Image):
        _check_pixels(value.size, what, limits)
        return np.asarray(value.convert("RGB"), dtype=np.uint8)
    if isinstance(value, str) and value.startswith("data:"):
        value = decode_data_url(value, what)
    elif isinstance(value, (str, Path)):
        if str(value).startswith(("http://", "https://")):
            raise DecodertError(f"{what}: remote image URLs are not fetched; pass a file, bytes or a data URL")
        value = _read_file(Path(value), what, limits)
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise DecodertError(f"{what} must be a path, bytes, a PIL image, an HxWx3 uint8 array or a data URL, "
                            f"not {type(value).__name__}")
    return decode_bytes(bytes(value), what, limits)


def decode_bytes(data: bytes, what: str, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise DecodertError(f"{what} is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            _check_pixels(img.size, what, limits)  # from the header: nothing is decoded yet
            img.load()
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except DecodertError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise DecodertError(f"{what} is a decompression bomb (too many pixels for its size)") from None
    except Exception as e:  # UnidentifiedImageError, truncated data, OSError, SyntaxError from a plugin
        raise DecodertError(f"{what} could not be decoded as an image ({type(e).__name__})") from None


def decode_data_url(url: str, what: str) -> bytes:
    """``data:image/png;base64,...`` -> the bytes."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise DecodertError(f"{what}: a data URL must be data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DecodertError(f"{what}: the data URL's base64 is malformed") from None


def _read_file(path: Path, what: str, limits: ImageLimits) -> bytes:
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise DecodertError(f"{what} {path} is {size} bytes; the limit is {limits.max_bytes}")
        return path.read_bytes()
    except OSError as e:
        raise DecodertError(f"{what} {path}: {e.strerror or e}") from None


def _from_array(a: np.ndarray, what: str, limits: ImageLimits) -> np.ndarray:
    if a.ndim != 3 or a.shape[2] != 3 or a.dtype != np.uint8 or 0 in a.shape:
        raise DecodertError(f"{what}: an array must be HxWx3 uint8 RGB, got {a.dtype} {list(a.shape)}")
    _check_pixels((a.shape[1], a.shape[0]), what, limits)
    return np.ascontiguousarray(a)


def _check_pixels(size: tuple[int, int], what: str, limits: ImageLimits) -> None:
    w, h = size
    if w * h > limits.max_pixels:
        raise DecodertError(f"{what} has {w}x{h} pixels; the limit is {limits.max_pixels}")
    if w < 1 or h < 1:
        raise DecodertError(f"{what} is empty ({w}x{h})")
