"""Decode contexts and CUDA graphs of the trt backend (runtime/backends/trt/backend.py), kept per KV cache.

A decode context binds a cache's addresses once per batch size, and its CUDA graph bakes them in, so
they are kept per cache, for the last ``KEEP_BAKED`` caches used (the shared cache and a session's:
switching between them captures nothing again); a freed cache's are dropped. ``capture`` records the
work of one decode step into a graph, or says why not (the step then runs plainly).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from decodert.errors import DecodertError
from decodert.plugins import cuda_mem as cm
from decodert.runtime.backends.kv_cache import KVCache

KEEP_BAKED = 2  # caches whose decode contexts and CUDA graphs are kept (the shared one, a session's)


@dataclass
class Baked:
    """Decode contexts and CUDA graphs bound to one cache's addresses (per decode batch size)."""

    cache: Any  # weakref.ref to the KVCache (None: nothing bound yet)
    ctx: dict[int, Any] = field(default_factory=dict)
    graphs: dict[int, cm.CudaGraph | None] = field(default_factory=dict)  # None: capture failed, run plainly
    warm: set[int] = field(default_factory=set)

    def destroy(self) -> None:
        for graph in self.graphs.values():
            if graph is not None:
                graph.destroy()
        self.ctx, self.graphs, self.warm = {}, {}, set()


class BakedCaches:
    """The ``Baked`` of the last ``KEEP_BAKED`` caches used, by cache id; ``now``: the bound cache's."""

    def __init__(self) -> None:
        self._by_cache: OrderedDict[int, Baked] = OrderedDict()
        self.now = Baked(None)

    def use(self, cache: KVCache) -> Baked:
        """Make ``cache``'s the current ones (new when its id was reused or it was freed)."""
        key = id(cache)
        baked = self._by_cache.get(key)
        if baked is not None and (baked.cache() is not cache or not cache.buffers):  # id reused, or freed
            self._by_cache.pop(key).destroy()
            baked = None
        if baked is None:
            baked = self._by_cache[key] = Baked(weakref.ref(cache))
        self._by_cache.move_to_end(key)
        while len(self._by_cache) > KEEP_BAKED:
            self._by_cache.popitem(last=False)[1].destroy()
        self.now = baked
        return baked

    def drop(self) -> None:
        for baked in self._by_cache.values():
            baked.destroy()
        self._by_cache.clear()
        self.now = Baked(None)


def capture(ctx: Any, stream: cm.Stream, enqueue: Callable[[], None], stats: dict[str, int], n: int) -> cm.CudaGraph | None:
    """A CUDA graph of ``enqueue`` (one decode step of batch ``n``), or None: the context cannot be captured or
    the capture failed (warned once, counted in ``stats``)."""
    if hasattr(ctx, "is_stream_capturable") and not ctx.is_stream_capturable(stream.handle):
        return None
    try:
        graph = cm.CudaGraph(stream, enqueue)
    except DecodertError as e:
        stats["capture_failures"] += 1
        cm.clear_last_error()  # a failed capture leaves a non-sticky error behind
        warnings.warn(f"CUDA graph capture of the decode step (batch {n}) failed, running without: {e}", stacklevel=3)
        return None
    stats["captures"] += 1
    return graph
