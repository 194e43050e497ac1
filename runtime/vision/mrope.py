"""M-RoPE positions (Qwen-VL) from the ids a cache row holds: no state of their own.

transformers' get_rope_index: text tokens count up one by one; an image of rows x cols merged tokens
that starts when the count is ``st`` puts token k at (t, h, w) = (st, st + k // cols, st + k % cols),
and the text after it goes on from ``st + max(rows, cols)``. A video grid of ``frames`` slices (Qwen2.5-VL)
puts token k of slice g at t = st + int(g * interval) (interval = tokens_per_second * seconds per slice,
float32 as torch computes it), h and w as an image's; the text after it goes on from one past its largest
position, st + max(int((frames - 1) * interval), rows - 1, cols - 1) + 1 (Qwen2.5-VL's own rule and the
rope delta transformers keeps for decoding; transformers 5's get_rope_index restarts such text at
st + max(rows, cols), which only differs when the temporal extent is the largest). Qwen3-VL's video slices
are separate grids of one slice each (timestamp text between them). Every image token is an image id
(runtime/vision/tokens.py) whose store entry knows its index k and its grid, so the positions of any
block of a row follow from the ids before it (``KVCache.held``) and its own: a chunked prefill, a
session's next turn and a reused prefix all get the same positions a full prefill gives, and a decode
step's offset is that of the next text token. The graphs take ``position - cache index`` per axis
(plugins/ops/mrope.py: rope_offsets [3, B, S]).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.vision.tokens import IMAGE_FLAG

Locate = Callable[[int], "tuple[int, int, int, int, float] | None"]  # image id -> (k, rows, cols, slices, interval)


def positions(ids: np.ndarray, locate: Locate) -> tuple[np.ndarray, int]:
    """ids [L] -> (positions [3, L] int64, the position of a text token after them)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    out = np.empty((3, len(ids)), np.int64)
    image = np.flatnonzero(ids >= IMAGE_FLAG)
    if image.size == 0:
        out[:] = np.arange(len(ids))
        return out, len(ids)
    breaks = np.flatnonzero(np.diff(image) != 1) + 1
    runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(image, breaks)]
    cur = done = 0
    for start, end in runs:
        out[:, done:start] = cur + np.arange(start - done)  # text
        cur += start - done
        j = start
        while j < end:  # one image (or several back to back)
            found = locate(int(ids[j]))
            if found is None:
                raise DecodertError("an image of this prompt is no longer in the image store; send it again")
            k, rows, cols, frames, interval = found
            area = rows * cols
            m = min(frames * area - k, end - j)
            kk = np.arange(k, k + m)
            out[0, j : j + m] = cur + ((kk // area).astype(np.float32) * np.float32(interval)).astype(np.int64)
            out[1, j : j + m] = cur + kk % area // cols
            out[2, j : j + m] = cur + kk % cols
            if k + m == frames * area:
                cur += max(int(np.float32(frames - 1) * np.float32(interval)) + 1 if frames > 1 else 0, rows, cols)
            j += m
        done = end
    out[:, done:] = cur + np.arange(len(ids) - done)
    return out, cur + len(ids) - done


def offsets(before: np.ndarray, new: np.ndarray, locate: Locate) -> np.ndarray:
    """rope_offsets [3, len(new)] of ``new`` ids written after ``before`` (cache index = len(before) + s)."""
    pos, _ = positions(np.concatenate([np.asarray(before, np.int64), np.asarray(new, np.int64)]), locate)
    return pos[:, len(before):] - np.arange(len(before), len(before) + len(new))


def next_offset(held: np.ndarray, locate: Locate) -> int:
    """The offset of a text token written after ``held`` (a decode step)."""
    held = np.asarray(held, np.int64)
    if not (held >= IMAGE_FLAG).any():
        return 0
    return positions(held, locate)[1] - len(held)
