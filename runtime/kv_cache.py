"""`KVCache`: the per-slot K/V state every backend allocates, on the host or on the GPU.

One class for the ort (CPU or CUDA execution provider) and trt backends: ``2 * layers`` buffers
``[slots, H_kv, max_seq, D]`` in the order k0, v0, k1, v1, ..., slots the outer (contiguous)
dimension, and ``lengths[slot]`` = tokens cached = the next write index. A backend binds
``pointer(i, slot)`` into its graphs or engines; runtime/kv_blocks.py copies position ranges
in and out through ``geometry()`` (device) or ``buffers`` (host).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from decodert.runtime import kv_blocks


class KVCache:
    """K/V buffers of ``slots`` rows for one backend; ``device`` "cpu" (numpy arrays) or "cuda" (DeviceBuffer).

    ``dtype``: the numpy element type (needed on the host); on the GPU a dtype numpy lacks (bf16)
    is given as ``itemsize`` alone. Device buffers start zeroed, as host ones do.
    """

    def __init__(self, slots: int, max_seq: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: Any = None, device: str = "cpu", itemsize: int | None = None) -> None:
        self.slots, self.max_seq, self.device = slots, max_seq, device
        self.dtype = np.dtype(dtype) if dtype is not None else None
        itemsize = itemsize if itemsize is not None else self.dtype.itemsize
        self.slot_shape = (kv_heads, max_seq, head_dim)
        self.kv_heads = kv_heads
        self.pos_bytes = head_dim * itemsize  # one position of one head
        self.slot_bytes = kv_heads * max_seq * self.pos_bytes  # one slot of one buffer
        if device == "cpu":
            self.buffers: list[Any] = [np.zeros((slots, *self.slot_shape), self.dtype) for _ in range(2 * layers)]
        else:
            from decodert.plugins.cuda_mem import DeviceBuffer

            self.buffers = [DeviceBuffer(slots * self.slot_bytes) for _ in range(2 * layers)]
        self.lengths = np.zeros(slots, np.int64)  # [slots]

    def pointer(self, i: int, slot: int) -> int:
        """Address of slot ``slot`` in buffer ``i``."""
        buf = self.buffers[i]
        base = buf.ctypes.data if self.device == "cpu" else buf.ptr
        return base + slot * self.slot_bytes

    def geometry(self) -> kv_blocks.DeviceGeometry:
        """Where each slot and position of the device buffers is (runtime/kv_blocks.py)."""
        return kv_blocks.DeviceGeometry([b.ptr for b in self.buffers], self.slot_bytes, self.pos_bytes,
                                        self.kv_heads, self.max_seq)

    def reset(self, slot: int | None = None) -> None:
        """Forget the cached tokens of one slot (or all); buffers are kept, not freed."""
        self.lengths[slice(None) if slot is None else slot] = 0

    def free(self) -> None:
        """Release the buffers now (device memory is freed; host arrays lose their reference)."""
        if self.device != "cpu":
            for buf in self.buffers:
                buf.free()
        self.buffers = []
