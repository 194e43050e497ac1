"""A CPU stand-in for the CUDA runtime that plugins/cuda_mem.py wraps, for tests without a GPU
(used by tests/helpers/trt_emulator.py, which adds TensorRT).

- **Memory**: device buffers and pinned host buffers are numpy allocations with real addresses.
  Every copy and every tensor an emulated engine reads or writes must lie inside one live
  allocation of the right kind (h2d: pinned host -> device, d2h, d2d), or ``EmulatorError``: an
  address bound at the wrong slot, a length past a buffer, a freed buffer.
- **Streams and CUDA graphs**: work enqueued on a stream runs at once, unless the stream is being
  captured; then it is recorded, and ``CudaGraph.launch`` replays it, reading the pinned host
  buffers at replay time as a real graph does (so a value written after capture is seen, and a
  pointer baked into a graph must still be right).

Not emulated: asynchrony between the host and the device (a missing stream sync is not caught).
"""

from __future__ import annotations

import bisect
from typing import Any, Callable

import numpy as np


class EmulatorError(AssertionError):
    """A misuse of CUDA or TensorRT that the real thing would crash on, or silently get wrong."""


# ---------------------------------------------------------------- memory
class Memory:
    """Live allocations: address -> (kind, bytes). Views are bounds-checked against them."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted addresses
        self.blocks: dict[int, tuple[str, np.ndarray]] = {}

    def alloc(self, nbytes: int, kind: str) -> tuple[int, np.ndarray]:
        raw = np.zeros(max(int(nbytes), 1), np.uint8)
        ptr = raw.ctypes.data
        bisect.insort(self.starts, ptr)
        self.blocks[ptr] = (kind, raw)
        return ptr, raw

    def free(self, ptr: int) -> None:
        if ptr not in self.blocks:
            raise EmulatorError(f"free of {ptr:#x}: not a live allocation")
        del self.blocks[ptr]
        self.starts.remove(ptr)

    def view(self, ptr: int, nbytes: int, kind: str, what: str) -> np.ndarray:
        """The ``nbytes`` at ``ptr`` (uint8, writable) inside one live allocation of ``kind``."""
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            raise EmulatorError(f"{what}: {ptr:#x} is not inside any live allocation")
        start = self.starts[i]
        got, raw = self.blocks[start]
        off = ptr - start
        if off + nbytes > raw.nbytes:
            raise EmulatorError(f"{what}: {nbytes} bytes at offset {off} overrun a {raw.nbytes}-byte {got} buffer")
        if got != kind:
            raise EmulatorError(f"{what}: {ptr:#x} is {got} memory, expected {kind}")
        return raw[off : off + nbytes]


class Device:
    """The emulated GPU: memory, streams, captures; ``api()`` is what replaces plugins/cuda_mem.py's names."""

    def __init__(self, free_bytes: int = 8 << 30) -> None:
        self.mem = Memory()
        self.free_bytes = free_bytes
        self.capturing: dict[int, list[Callable[[], None]]] = {}  # stream handle -> recorded work
        self.next_handle = 1
        self.live_streams: set[int] = set()
        self.counts = {"copies": 0, "engine_runs": 0, "replays": 0}

    def enqueue(self, handle: int, work: Callable[[], None]) -> None:
        if handle not in self.live_streams:
            raise EmulatorError(f"work enqueued on stream {handle}, which is not a live stream")
        if handle in self.capturing:
            self.capturing[handle].append(work)
        else:
            work()

    def copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        kinds = {"h2d": ("device", "host"), "d2h": ("host", "device"), "d2d": ("device", "device")}
        if kind not in kinds:
            raise EmulatorError(f"copy kind {kind!r}")
        dk, sk = kinds[kind]
        self.mem.view(dst, nbytes, dk, f"{kind} copy destination")[:] = self.mem.view(src, nbytes, sk, f"{kind} copy source")
        self.counts["copies"] += 1

    def api(self) -> dict[str, Any]:
        """plugins/cuda_mem.py's names, bound to this device."""
        classes = {name: type(name, (base,), {"dev": self}) for name, base in
                   (("DeviceBuffer", _DeviceBuffer), ("PinnedArray", _PinnedArray), ("Stream", _Stream),
                    ("CudaGraph", _CudaGraph))}
        info = {"name": "emulated", "compute_capability": "sm_89", "total_bytes": self.free_bytes}
        return {**classes, "copy_async": self.copy_async, "copy_2d_async": self.copy_2d_async,
                "gpu_count": lambda: 1, "set_device": lambda device: None, "clear_last_error": lambda: None,
                "device_info": lambda device=0: dict(info), "mem_get_info": lambda: (self.free_bytes, self.free_bytes)}

    def copy_async(self, dst: int, src: int, nbytes: int, stream: "_Stream", kind: str) -> None:
        if nbytes > 0:
            self.enqueue(stream.handle, lambda: self.copy(dst, src, nbytes, kind))

    def copy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream: "_Stream") -> None:
        def work() -> None:
            for r in range(rows):
                self.copy(dst + r * dpitch, src + r * spitch, width, "d2d")

        if width > 0 and rows > 0:
            self.enqueue(stream.handle, work)


class _DeviceBuffer:
    dev: Device

    def __init__(self, nbytes: int, zero: bool = True) -> None:
        self.nbytes = max(int(nbytes), 1)
        self.ptr, raw = self.dev.mem.alloc(self.nbytes, "device")
        if not zero:  # uninitialised device memory: make a read before a write visible
            raw.fill(0xA5)

    def free(self) -> None:
        if self.ptr:
            self.dev.mem.free(self.ptr)
            self.ptr = 0


class _PinnedArray:
    dev: Device

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * self.dtype.itemsize
        self.nbytes = max(n, 1)
        self.ptr, raw = self.dev.mem.alloc(self.nbytes, "host")
        self.array = raw[:n].view(self.dtype).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            self.array = np.empty(0, self.dtype)
            self.dev.mem.free(self.ptr)
            self.ptr = 0


class _Stream:
    dev: Device

    def __init__(self) -> None:
        self.handle = self.dev.next_handle
        self.dev.next_handle += 1
        self.dev.live_streams.add(self.handle)

    def sync(self) -> None:
        if self.handle in self.dev.capturing:
            raise EmulatorError("stream synchronize during a CUDA graph capture")

    def destroy(self) -> None:
        self.dev.live_streams.discard(self.handle)
        self.handle = 0


class _CudaGraph:
    """Records what ``enqueue`` puts on the stream; ``launch`` replays it."""

    dev: Device

    def __init__(self, stream: _Stream, enqueue: Callable[[], None]) -> None:
        if stream.handle in self.dev.capturing:
            raise EmulatorError("nested capture")
        self.stream = stream
        self.work: list[Callable[[], None]] | None = None
        self.dev.capturing[stream.handle] = []
        try:
            enqueue()
        finally:
            self.work = self.dev.capturing.pop(stream.handle)

    def launch(self) -> None:
        if self.work is None:
            raise EmulatorError("launch of a destroyed CUDA graph")
        self.dev.counts["replays"] += 1
        for w in self.work:
            self.dev.enqueue(self.stream.handle, w)

    def destroy(self) -> None:
        self.work = None
