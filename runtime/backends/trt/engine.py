"""TensorRT engines and execution contexts, shared by the trt backend's steps (runtime/backends/trt/backend.py)
and its verify passes (runtime/backends/trt/verify.py): deserialize and check an engine, make a context on
shared scratch memory, bind addresses and shapes, stage per-call inputs (``Staged``), and group a call's rows
into runs of slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.manifest import GraphRecord, Manifest
from decodert.artifact.trt_engines import check_io, engine_io, graph_of
from decodert.plugins import cuda_mem as cm
from decodert.plugins.trt.compat import TrtInfo
from decodert.runtime.backends import kv_cache
from decodert.runtime.backends.kv_cache import KVCache
from decodert.runtime.backends.trt.refit import refit_from_onnx


class TrtHost(Protocol):
    """What engines and the verifier use of the trt backend (runtime/backends/trt/backend.py TrtBackend)."""

    trt: Any
    info: TrtInfo
    dir: Path
    manifest: Manifest
    runtime: Any
    logger: Any
    runtime_cache: Any
    scratch: cm.DeviceBuffer
    stream: cm.Stream
    stats: dict[str, int]
    max_batch: int
    max_seq: int
    vocab_size: int
    itemsize: int
    hidden_bytes: int  # one row of the hidden-state outputs (0 without --hidden-states: never bound)
    mrope: Any  # runtime/backends/trt/mrope.py RopeOffsets, or None (no rope_offsets input)

    def check_validity(self, path: Path, blob: bytes) -> None: ...

    def check_rows(self, cache: KVCache, slots: Sequence[int], counts: Sequence[int]) -> None: ...

    def io_shapes(self, n: int, seq: int) -> dict[str, tuple[int, ...]]: ...

    def kv_addresses(self, cache: KVCache, row0: int) -> dict[str, int]: ...

    def execute(self, ctx: Any, what: str) -> None: ...


def kv_pairs(graph: GraphRecord, prefixes: tuple[str, ...] = ("past_key.", "past_value.")) -> list[tuple[str, str]]:
    """[("past_key.0", "present_key.0"), ("past_value.0", "present_value.0"), ...] in graph input order;
    ``prefixes=STATE_PREFIXES``: the conv / recurrent states of a hybrid model instead."""
    names = [t.name for t in graph.inputs if t.name.startswith(prefixes)]
    return [(n, "present_" + n[len("past_"):]) for n in names]


STATE_PREFIXES = ("past_conv.", "past_recurrent.")


def contiguous_runs(slots: Sequence[int]) -> Iterator[list[tuple[int, int]]]:
    """[(j, slot)] groups with consecutive slot numbers, j = position in ``slots`` (runtime/backends/kv_cache.py)."""
    for run in kv_cache.contiguous_runs(slots):
        yield [(j, int(slots[j])) for j in run]


class Engine:
    """One deserialized engine, the KV tensor names it aliases, and a context factory."""

    def __init__(self, backend: TrtHost, name: str, blob: bytes) -> None:
        trt, info = backend.trt, backend.info
        self.trt, self.info, self.name = trt, info, name
        path = backend.dir / (backend.manifest.engines or {})[name].file
        backend.check_validity(path, blob)
        self.engine = backend.runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise DecodertError(f"{path}: TensorRT could not deserialize the engine (set DECODERT_TRT_VERBOSE=1)")
        graph = graph_of(backend.manifest, name)  # a text graph, or the vision graph
        if (backend.manifest.engines or {})[name].weights_stripped:  # weights only in weights.bin: refit them
            refit_from_onnx(trt, self.engine, backend.dir / graph.file, backend.logger, path)
        check_io(engine_io(trt, self.engine, graph), graph, str(path))
        self.kv_pairs = kv_pairs(graph)
        for past, present in self.kv_pairs + kv_pairs(graph, STATE_PREFIXES) if info.has_aliased_io else []:
            alias = self.engine.get_aliased_input_tensor(present)  # None: TensorRT does not say
            if alias not in (None, past):
                raise DecodertError(f"{path}: output {present} aliases {alias}, not {past}; re-export and rebuild")
        self.scratch_bytes = int(self.engine.device_memory_size_v2)
        self.runtime_cache = backend.runtime_cache

    def context(self, scratch: cm.DeviceBuffer) -> Any:
        trt = self.trt
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        if self.info.has_runtime_cache:  # TensorRT-RTX: the runtime config carries the JIT cache
            cfg = self.engine.create_runtime_config()
            cfg.set_execution_context_allocation_strategy(strategy)
            if self.runtime_cache is not None:
                cfg.set_runtime_cache(self.runtime_cache)
            if hasattr(cfg, "dynamic_shapes_kernel_specialization_strategy"):  # compile shape-specialised
                eager = trt.DynamicShapesKernelSpecializationStrategy.EAGER  # kernels on first use, so a
                cfg.dynamic_shapes_kernel_specialization_strategy = eager  # later CUDA graph captures them
            ctx = self.engine.create_execution_context(cfg)
        else:
            ctx = self.engine.create_execution_context(strategy)
        if ctx is None:
            raise DecodertError(f"TensorRT could not create an execution context for the {self.name} engine")
        ctx.set_device_memory(scratch.ptr, scratch.nbytes)
        return ctx


def bind(ctx: Any, addresses: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]]) -> None:
    for name, ptr in addresses.items():
        if not ctx.set_tensor_address(name, ptr):
            raise DecodertError(f"TensorRT rejected the address of tensor '{name}'")
    for name, shape in shapes.items():
        if not ctx.set_input_shape(name, shape):
            raise DecodertError(f"input '{name}' shape {shape} is outside the engine's profile "
                                "(rebuild with a larger --max-batch / --max-seq)")


def fitting_runs(slots: Sequence[int], lengths: np.ndarray, counts: Sequence[int], max_seq: int) -> Iterator[list[tuple[int, int]]]:
    """runtime/backends/kv_cache.py ``fitting_runs`` as (row, slot) pairs: runs whose padded call stays inside the cache."""
    for run in kv_cache.fitting_runs(slots, lengths, counts, max_seq):
        yield [(j, slots[j]) for j in run]


class Staged:
    """A pinned host buffer and a device buffer of the same size, grown on demand."""

    def __init__(self) -> None:
        self.host: cm.PinnedArray | None = None
        self.dev: cm.DeviceBuffer | None = None

    def put(self, arr: np.ndarray, stream: cm.Stream) -> int:
        """Copy ``arr`` to the device (enqueued on ``stream``); returns the device address."""
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        ptr = self.reserve(raw.size)
        assert self.host is not None
        self.host.array[: raw.size] = raw
        cm.copy_async(ptr, self.host.ptr, raw.size, stream, "h2d")
        return ptr

    def reserve(self, nbytes: int) -> int:
        """The device address of at least ``nbytes`` (an output ``fetch`` copies back)."""
        if self.host is None or self.host.nbytes < nbytes:
            self.free()
            self.host, self.dev = cm.PinnedArray((max(nbytes, 1),), np.uint8), cm.DeviceBuffer(max(nbytes, 1))
        assert self.dev is not None
        return self.dev.ptr

    def fetch(self, nbytes: int, stream: cm.Stream) -> None:
        """Enqueue the d2h copy of the first ``nbytes`` (read ``host.array`` after the stream syncs)."""
        assert self.host is not None and self.dev is not None
        cm.copy_async(self.host.ptr, self.dev.ptr, nbytes, stream, "d2h")

    def free(self) -> None:
        for buf in (self.host, self.dev):
            if buf is not None:
                buf.free()
        self.host = self.dev = None
