"""What a backend binds for a vision-language model beyond the ids, on ort (runtime/backends/ort/backend.py) and trt
(runtime/backends/trt/images.py, trt_mrope.py) alike: the image rows (Gemma 3's image_ahead, Qwen3-VL's deepstack
rows) at the image ids' positions, and M-RoPE's rope_offsets, all read from the image store
(runtime/vision/encoder.py) and the ids a row holds (runtime/vision/mrope.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from decodert.runtime.vision import mrope
from decodert.runtime.vision.tokens import image_ahead, text_ids


def locator(store: Any) -> mrope.Locate:
    """image id -> (index in its image, rows, cols), or None (no store: a text-only backend)."""
    return store.locate if store is not None else (lambda image_id: None)


def image_arrays(ids: np.ndarray, store: Any, hidden: int, np_dtype: type, deepstack: int,
                 ahead: bool = False) -> dict[str, np.ndarray]:
    """image_positions [N], image_embeds [N, hidden] (and deepstack_embeds [k, N, hidden], image_ahead [N]) for a
    [n, S] block of ids, empty when it holds no image ids; the image ids in ``ids`` become the image token (in place)."""
    found = store.rows(ids) if store is not None else None
    extra: list[np.ndarray]
    if found is None:
        found = (np.zeros(0, np.int64), np.zeros((0, hidden), np_dtype))
        extra = [np.zeros((deepstack, 0, hidden), np_dtype)] if deepstack else []
    else:
        extra = [store.extra_rows(ids, "deepstack_embeds")] if deepstack else []  # Qwen3-VL
        ids[:] = text_ids(ids)
    out = {"image_positions": np.ascontiguousarray(found[0], np.int64),
           "image_embeds": np.ascontiguousarray(found[1], np_dtype)}
    if extra:
        out["deepstack_embeds"] = np.ascontiguousarray(extra[0], np_dtype)
    if ahead:  # Gemma 3: how many later tokens of its image each image token sees
        out["image_ahead"] = image_ahead(out["image_positions"], ids.shape[1])
    return out


def set_offsets(offsets: np.ndarray | None, j: int, held: np.ndarray, new: np.ndarray, store: Any) -> None:
    """Row ``j`` of rope_offsets [3, n, S] for ``new`` ids written after ``held`` (no-op without M-RoPE)."""
    if offsets is None:
        return
    offsets[:, j] = 0
    offsets[:, j, : len(new)] = mrope.offsets(held, new, locator(store))


def next_offset(held: np.ndarray, store: Any) -> int:
    """The rope offset of a decode step's token written after ``held``."""
    return mrope.next_offset(held, locator(store))
