"""`KVCache`: the per-slot K/V state every backend allocates, on the host or on the GPU.

One class for the ort (CPU or CUDA execution provider) and trt backends: ``2 * layers`` buffers
``[slots, H_kv, max_seq, D]`` in the order k0, v0, k1, v1, ..., slots the outer (contiguous)
dimension, and ``lengths[slot]`` = tokens cached = the next write index. A backend binds
``pointer(i, slot)`` into its graphs or engines; runtime/backends/kv_blocks.py copies position ranges
in and out through ``geometry()`` (device) or ``buffers`` (host).

The rule: **row ``slot`` holds K/V for exactly the ids ``held(slot)``**: positions 0 .. n-1
(n = ``lengths[slot]``) were written by the model for those ids, in that order. This object is the
only writer of that record, through four verbs: ``commit`` (a backend, or the prefix cache, wrote K/V
for new ids), ``rewind`` (drop positions from the end: rejected drafts, a session turn that diverges),
``reset``, and ``move`` (a backend copied a row to another slot). K/V depend on the LoRA adapter the
row ran under too: ``use_adapter`` sets it (the graphs read ``adapters`` as each row's ``lora_index``) and
empties a row that holds K/V of another adapter, so no row ever mixes them. ``lengths``
is a read-only view: nothing else can change what a row says it holds, so the prefix cache, sessions
and speculation read the ids from here instead of assuming them (docs/ARCHITECTURE.md, "Cache state").
Per-row recurrent state (hybrid models) will be owned here too, under the same verbs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.backends import kv_blocks


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
        self._lengths = np.zeros(slots, np.int64)  # [slots] tokens cached = the next write index
        self.lengths = self._lengths.view()  # read-only: only the verbs below change it
        self.lengths.flags.writeable = False
        self._held = np.zeros((slots, max_seq), np.int64)  # [slots, max_seq] the ids whose K/V each row holds
        self._adapter = np.zeros(slots, np.int64)  # [slots] LoRA slot each row runs under (the graphs' lora_index; 0 none)
        self.adapters = self._adapter.view()  # read-only: backends bind it
        self.adapters.flags.writeable = False
        self._adapter_tag = np.zeros(slots, np.int64)  # [slots] which loaded adapter that is (unique per load; 0 none)

    def pointer(self, i: int, slot: int) -> int:
        """Address of slot ``slot`` in buffer ``i``."""
        buf = self.buffers[i]
        base = buf.ctypes.data if self.device == "cpu" else buf.ptr
        return base + slot * self.slot_bytes

    def geometry(self) -> kv_blocks.DeviceGeometry:
        """Where each slot and position of the device buffers is (runtime/backends/kv_blocks.py)."""
        return kv_blocks.DeviceGeometry([b.ptr for b in self.buffers], self.slot_bytes, self.pos_bytes,
                                        self.kv_heads, self.max_seq)

    # -- what a row holds: the only writers ---------------------------------------------------
    def held(self, slot: int) -> np.ndarray:
        """The ids whose K/V row ``slot`` holds, in position order (a copy) [lengths[slot]]."""
        return self._held[slot, : self._lengths[slot]].copy()

    def check_room(self, slots: Sequence[int], counts: Sequence[int] | np.ndarray, what: str = "the tokens") -> None:
        """DecodertError unless every row has room for its ``counts[j]`` new positions."""
        past = self._lengths[list(slots)]
        if (past + np.asarray(counts, np.int64) > self.max_seq).any():
            raise DecodertError(f"{what} do not fit: the KV cache is full ({self.max_seq} tokens per row; "
                                "export with a larger --max-seq)")

    def commit(self, slots: Sequence[int], ids: Sequence[np.ndarray] | np.ndarray) -> None:
        """The backend has just written K/V for ``ids[j]`` at ``lengths[slots[j]]`` onwards: record them."""
        rows = [np.asarray(r, np.int64).reshape(-1) for r in ids]
        if len(rows) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"commit: {len(rows)} rows for slots {list(slots)}")
        self.check_room(slots, [len(r) for r in rows])
        for slot, row in zip(slots, rows):
            start = self._lengths[slot]
            self._held[slot, start : start + len(row)] = row
            self._lengths[slot] = start + len(row)

    def use_adapter(self, slot: int, index: int, tag: int) -> None:
        """Row ``slot``'s next K/V are computed under the adapter loaded as ``tag`` into LoRA slot ``index``
        (0, 0: none). A row holding K/V of another adapter is emptied first: K/V never mix adapters."""
        if self._adapter_tag[slot] != tag:
            self._lengths[slot] = 0
        self._adapter[slot], self._adapter_tag[slot] = index, tag

    def adapter_tag(self, slot: int) -> int:
        """The adapter (its load tag; 0: none) the K/V of row ``slot`` were computed under."""
        return int(self._adapter_tag[slot])

    def rewind(self, slot: int, to: int) -> None:
        """Keep only the first ``to`` positions of ``slot`` (later K/V stays, unread, until overwritten)."""
        if not 0 <= to <= self._lengths[slot]:
            raise ValueError(f"rewind slot {slot} to {to}: it holds {int(self._lengths[slot])} tokens")
        self._lengths[slot] = to

    def reset(self, slot: int | None = None) -> None:
        """Forget the cached tokens of one slot (or all); buffers are kept, not freed."""
        self._lengths[slice(None) if slot is None else slot] = 0

    def move(self, src: int, dst: int) -> None:
        """The backend has copied row ``src``'s positions into ``dst``: ``dst`` holds what ``src`` held, ``src`` nothing."""
        if src == dst:
            return
        n = self._lengths[src]
        self._held[dst, :n] = self._held[src, :n]
        self._lengths[dst], self._lengths[src] = n, 0
        self._adapter[dst], self._adapter_tag[dst] = self._adapter[src], self._adapter_tag[src]

    def free(self) -> None:
        """Release the buffers now (device memory is freed; host arrays lose their reference)."""
        if self.device != "cpu":
            for buf in self.buffers:
                buf.free()
        self.buffers = []


def contiguous_runs(slots: Sequence[int]) -> list[list[int]]:
    """Indices into ``slots`` grouped into runs of consecutive slot numbers, in slot order (one bound
    call each: a run's first index has its lowest slot)."""
    runs: list[list[int]] = []
    for j in sorted(range(len(slots)), key=lambda j: slots[j]):
        if runs and slots[runs[-1][-1]] + 1 == slots[j]:
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


def fitting_runs(slots: Sequence[int], lengths: np.ndarray, counts: Sequence[int] | np.ndarray, max_seq: int) -> list[list[int]]:
    """``contiguous_runs``, split so that each run's padded call stays inside the cache.

    A run is one call of width max(counts) over rows right-padded to it, and a call writes K/V (and
    takes RoPE positions) at past .. past + width - 1 of every row; a row with less room than that
    (a short row near the end of its context beside a longer one) runs alone, at its own width."""
    out: list[list[int]] = []
    for run in contiguous_runs(slots):
        width = max(counts[j] for j in run)
        if all(lengths[slots[j]] + width <= max_seq for j in run):
            out.append(run)
        else:
            out.extend([j] for j in run)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the longest common prefix of id arrays ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), max(limit, 0))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
