"""Copies of a slot's cached positions, in and out, where the cache lives (host arrays or GPU memory).

A *block* is the K/V of ``n`` consecutive positions of one slot, for every layer:

    host:   np.ndarray [2 * layers, H_kv, n, D]    (buffers in cache order: k0, v0, k1, v1, ...)
    device: DeviceBlock, the same layout in one device allocation

The prefix cache (runtime/prefix_cache.py) keeps blocks between requests and sessions; the
backends implement ``read_kv`` / ``write_kv`` / ``free_kv`` / ``kv_bytes`` with these helpers.
Cache buffers are [slots, H_kv, max_seq, D] per layer, so one position range of one slot is
H_kv strided rows of ``n * D`` elements: a 2-D copy per buffer, no reshuffle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


def host_read(buffers: Sequence[np.ndarray], slot: int, start: int, n: int) -> np.ndarray | list[np.ndarray]:
    """Positions [start, start+n) of ``slot`` from every buffer -> a new [2L, H_kv, n, D] array (a list of
    [H_kv, n, D_i] arrays where layers differ in D: Gemma 4)."""
    first = buffers[0]
    if len({b.shape[3] for b in buffers}) > 1:
        return [buf[slot, :, start : start + n].copy() for buf in buffers]
    out = np.empty((len(buffers), first.shape[1], n, first.shape[3]), first.dtype)  # [2L, H_kv, n, D]
    for i, buf in enumerate(buffers):
        out[i] = buf[slot, :, start : start + n]
    return out


def host_write(buffers: Sequence[np.ndarray], slot: int, start: int, block: np.ndarray | list[np.ndarray]) -> None:
    """Copy ``block`` [2L, H_kv, n, D] (or host_read's list) into positions [start, start+n) of ``slot``."""
    n = block[0].shape[1]
    for buf, part in zip(buffers, block):
        buf[slot, :, start : start + n] = part


@dataclass
class DeviceGeometry:
    """Where slot ``s``, position ``p`` of buffer ``i`` is: ``ptrs[i] + s * row_bytes + p * pos_bytes``
    (heads ``max_seq * pos_bytes`` apart)."""

    ptrs: list[int]  # [2L] device addresses of the cache buffers
    row_bytes: int  # one slot of one buffer: H_kv * max_seq * D * itemsize
    pos_bytes: int  # one position of one head: D * itemsize
    heads: int  # H_kv
    max_seq: int

    def block_bytes(self, n: int) -> int:
        return len(self.ptrs) * self.heads * n * self.pos_bytes


class DeviceBlock:
    """A block in device memory: [2L, H_kv, n, D] in one allocation of ``nbytes``; ``free()`` returns it."""

    def __init__(self, buffer: Any, n: int) -> None:
        self.buffer, self.n, self.nbytes = buffer, n, buffer.nbytes

    def free(self) -> None:
        self.buffer.free()


def device_read(geo: DeviceGeometry, slot: int, start: int, n: int, stream: Any) -> DeviceBlock:
    """Positions [start, start+n) of ``slot`` -> a new DeviceBlock (device-to-device, waits for the copy)."""
    from decodert.plugins import cuda_mem as cm

    block = DeviceBlock(cm.DeviceBuffer(geo.block_bytes(n), zero=False), n)
    part, width, pitch = geo.heads * n * geo.pos_bytes, n * geo.pos_bytes, geo.max_seq * geo.pos_bytes
    for i, ptr in enumerate(geo.ptrs):
        src = ptr + slot * geo.row_bytes + start * geo.pos_bytes
        cm.copy_2d_async(block.buffer.ptr + i * part, width, src, pitch, width, geo.heads, stream)
    stream.sync()
    return block


def device_write(geo: DeviceGeometry, slot: int, start: int, block: DeviceBlock, stream: Any) -> None:
    """Copy ``block`` into positions [start, start+block.n) of ``slot`` (waits for the copy)."""
    from decodert.plugins import cuda_mem as cm

    n = block.n
    part, width, pitch = geo.heads * n * geo.pos_bytes, n * geo.pos_bytes, geo.max_seq * geo.pos_bytes
    for i, ptr in enumerate(geo.ptrs):
        dst = ptr + slot * geo.row_bytes + start * geo.pos_bytes
        cm.copy_2d_async(dst, pitch, block.buffer.ptr + i * part, width, width, geo.heads, stream)
    stream.sync()


def free_block(block: Any) -> None:
    """Release a block's memory now (device blocks); host arrays just go with their last reference."""
    free = getattr(block, "free", None)
    if free is not None:
        free()


# ---- blocks as bytes (runtime/persist/disk_tier.py): one layout for host and device blocks alike -------------
def host_bytes(block: Any) -> np.ndarray:
    """A host block (an array, or host_read's list) -> its bytes [nbytes] uint8: each buffer's [H_kv, n, D_i] in
    cache order, back to back, which is a DeviceBlock's layout too."""
    if not isinstance(block, list):
        return np.ascontiguousarray(block).reshape(-1).view(np.uint8)  # a view: a prefix entry's block is never written
    return np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in block])


def host_from_bytes(buffers: Sequence[np.ndarray], data: np.ndarray, n: int) -> np.ndarray | list[np.ndarray]:
    """``host_bytes``' inverse for a cache of ``buffers`` (what host_read would give for ``n`` positions), a view of
    ``data`` (the caller gives up its array: a prefix entry's block is only ever read); ValueError when the size is
    not that block's."""
    shapes = [(b.shape[1], n, b.shape[3]) for b in buffers]
    sizes = [int(np.prod(s)) * b.dtype.itemsize for s, b in zip(shapes, buffers)]
    if data.nbytes != sum(sizes):
        raise ValueError(f"a block of {n} positions is {sum(sizes)} bytes, not {data.nbytes}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if len({b.shape[3] for b in buffers}) > 1:
        offsets = np.cumsum([0, *sizes])
        return [raw[offsets[i]:offsets[i + 1]].view(b.dtype).reshape(s) for i, (b, s) in enumerate(zip(buffers, shapes))]
    return raw.view(buffers[0].dtype).reshape(len(buffers), *shapes[0])  # [2L, H_kv, n, D]


def device_bytes(block: DeviceBlock, stream: Any) -> np.ndarray:
    """A DeviceBlock -> its bytes on the host [nbytes] uint8 (through pinned memory; waits for the copy)."""
    from decodert.plugins import cuda_mem as cm

    host = cm.PinnedArray((block.nbytes,), np.uint8)
    try:
        cm.copy_async(host.ptr, block.buffer.ptr, block.nbytes, stream, "d2h")
        stream.sync()
        return host.array.copy()
    finally:
        host.free()


def device_from_bytes(geo: DeviceGeometry, data: np.ndarray, n: int, stream: Any) -> DeviceBlock:
    """Bytes of ``device_bytes`` (or ``host_bytes``) -> a new DeviceBlock of ``n`` positions; ValueError when the size
    is not that block's."""
    from decodert.plugins import cuda_mem as cm

    if data.nbytes != geo.block_bytes(n):
        raise ValueError(f"a block of {n} positions is {geo.block_bytes(n)} bytes, not {data.nbytes}")
    host = cm.PinnedArray((data.nbytes,), np.uint8)
    block = DeviceBlock(cm.DeviceBuffer(data.nbytes, zero=False), n)
    try:
        host.array[:] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        cm.copy_async(block.buffer.ptr, host.ptr, data.nbytes, stream, "h2d")
        stream.sync()
    except BaseException:
        block.free()
        raise
    finally:
        host.free()
    return block
