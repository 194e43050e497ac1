"""Image tokens keyed by the pixels.

Every image token of a prompt is held as an *image id*: ``IMAGE_FLAG | h << 20 | token``, where
``token`` is the checkpoint's ``<image>`` id (< 2^20) and ``h`` a 42-bit hash of (the image's pixel
digest, the token's index in the image). The KV cache's record of what a row holds, the prefix cache's
keys and a session's common prefix all compare ids, so they compare images by their pixels: the same
image at the same place is the same ids (a follow-up question prefills only the new turn), another
image differs from its first token on. ``text_ids`` maps them back to ``<image>`` wherever token ids
are read as vocabulary (the graph's embedding gather, penalties, detokenizing, drafting).
"""

from __future__ import annotations

import hashlib

import numpy as np

IMAGE_FLAG = np.int64(1 << 62)
TOKEN_BITS = 20
_TOKEN_MASK = np.int64((1 << TOKEN_BITS) - 1)
_HASH_MASK = (1 << 42) - 1


def pixel_digest(rgb: np.ndarray) -> bytes:
    """16 bytes naming an RGB uint8 image [H, W, 3] by its shape and pixels."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(rgb.shape, np.int64).tobytes())
    h.update(np.ascontiguousarray(rgb).data)
    return h.digest()


def image_ids(digest: bytes, token_id: int, n: int) -> np.ndarray:
    """The ``n`` image ids [n] int64 of one image (its tokens in order)."""
    if not 0 <= token_id <= int(_TOKEN_MASK):
        raise ValueError(f"image token id {token_id} does not fit {TOKEN_BITS} bits")
    out = np.empty(n, np.int64)
    for k in range(n):
        h = int.from_bytes(hashlib.blake2b(digest + k.to_bytes(4, "little"), digest_size=8).digest(), "little")
        out[k] = int(IMAGE_FLAG) | (h & _HASH_MASK) << TOKEN_BITS | token_id
    return out


def is_image(ids: np.ndarray) -> np.ndarray:
    return np.asarray(ids) >= IMAGE_FLAG


def text_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` with every image id replaced by its ``<image>`` token id (a copy only when there are some)."""
    ids = np.asarray(ids, dtype=np.int64)
    mask = ids >= IMAGE_FLAG
    return np.where(mask, ids & _TOKEN_MASK, ids) if mask.any() else ids


def image_ahead(positions: np.ndarray, seq: int) -> np.ndarray:
    """For the flat positions [N] (b * seq + s, ascending) of a call's image tokens: how many later tokens
    of the same run of image tokens in the same row each one sees (a model whose image tokens attend both
    ways, ModelSpec.bidirectional_images; transformers' blocks are such runs)."""
    positions = np.asarray(positions, np.int64)
    if positions.size == 0:
        return positions.copy()
    joined = (np.diff(positions) == 1) & (positions[1:] // seq == positions[:-1] // seq)
    ends = np.flatnonzero(np.append(~joined, True))  # the last index of each run
    return positions[ends[np.searchsorted(ends, np.arange(positions.size))]] - positions
