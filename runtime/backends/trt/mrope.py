"""M-RoPE on the trt backend (Qwen-VL): the rope_offsets input of the prefill, decode and verify engines.

    host (pinned)                     device (fixed per graph)
    prefill [3*B*Sp] int64  --h2d-->  rope_offsets [3, k, S]   each row's offsets after what its slot holds
    decode  [3*B]    int64  --h2d-->  rope_offsets [3, n, 1]   each row's next text position - its length
    verify  [3*B*W]  int64  --h2d-->  rope_offsets [3, k, w]

The offsets follow from the ids a cache row holds and the call's own ids, by the rule ort uses too
(runtime/backends/image_feeds.py over runtime/vision/mrope.py): nothing of their own to keep. The decode
buffers' addresses are bound once and the h2d copy is part of the work a decode CUDA graph replays
(``enqueue_decode``), so a step only rewrites the pinned host rows before it runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from decodert.plugins import cuda_mem as cm
from decodert.plugins.ops.mrope import OFFSETS
from decodert.runtime.backends.image_feeds import next_offset, set_offsets
from decodert.runtime.backends.kv_cache import KVCache


def takes_offsets(manifest: Any) -> bool:
    """Whether the text engines were built taking rope_offsets (an M-RoPE model's engines built before they did
    fold them to zeros: text positions, right for text only)."""
    recs = manifest.engines or {}
    built = [n for n in ("prefill", "decode", "verify") if n in recs]
    return bool(built) and all(OFFSETS in (recs[n].profile or {}) for n in built)


class RopeOffsets:
    """Pinned host rows and device buffers of rope_offsets for each text graph, sized for its largest call."""

    def __init__(self, backend: Any, widths: dict[str, int]) -> None:
        """``widths``: graph kind -> the most tokens one row of its call takes."""
        self.backend = backend
        self.h = {kind: cm.PinnedArray((3 * backend.max_batch * max(w, 1),), np.int64) for kind, w in widths.items()}
        self.d = {kind: cm.DeviceBuffer(h.nbytes) for kind, h in self.h.items()}

    def address(self, kind: str) -> dict[str, int]:
        return {OFFSETS: self.d[kind].ptr}

    def write(self, kind: str, cache: KVCache, rows: Sequence[tuple[int, np.ndarray]], width: int) -> None:
        """[3, k, width] for the call's rows (slot, new ids), written after what each slot holds; h2d enqueued."""
        k = len(rows)
        off = self.h[kind].array[: 3 * k * width].reshape(3, k, width)
        for r, (slot, new) in enumerate(rows):
            set_offsets(off, r, cache.held(slot), new, self.backend.images)
        cm.copy_async(self.d[kind].ptr, self.h[kind].ptr, off.nbytes, self.backend.stream, "h2d")

    def write_decode(self, cache: KVCache, slots: Sequence[int]) -> None:
        """The host rows [3, n] of a decode step (``enqueue_decode`` copies them)."""
        n = len(slots)
        self.h["decode"].array[: 3 * n].reshape(3, n)[:] = [next_offset(cache.held(s), self.backend.images)
                                                             for s in slots]

    def enqueue_decode(self, n: int) -> None:
        cm.copy_async(self.d["decode"].ptr, self.h["decode"].ptr, 3 * n * 8, self.backend.stream, "h2d")

    def free(self) -> None:
        buffers: list[cm.PinnedArray | cm.DeviceBuffer] = [*self.h.values(), *self.d.values()]
        for buf in buffers:
            buf.free()
        self.h, self.d = {}, {}
