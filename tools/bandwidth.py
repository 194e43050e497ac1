"""What a decode step costs the memory: the weight bytes it reads, and the machine's measured read and copy
bandwidth (``decodert bench``'s floor: read bandwidth / bytes per step).

Bytes per step are the weights the decode graph reads: every initializer in full, except tables only read by
Gather (the embedding when the output projection is a separate or quantized copy, the RoPE tables, the scales
GatherBlockQuantized uses), which read one row per token; a MoE layer's experts count the active ones only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from decodert.artifact.manifest import Manifest


def memcopy_gbps(mib: int = 256, tries: int = 5, threads: int | None = None) -> float:
    """Best of ``tries`` numpy copies of a ``mib`` MiB buffer, split over ``threads`` (default: all
    cores; one thread does not saturate memory), counted as bytes read + bytes written."""
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_split(lambda a, b: np.copyto(dst[a:b], src[a:b]), src.size, tries, threads) / 1e9


def memread_gbps(mib: int = 256, tries: int = 5, threads: int | None = None) -> float:
    """Like ``memcopy_gbps`` but only reading (a float32 sum): what a decode step does to its weights."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    return src.nbytes / _best_split(lambda a, b: np.add.reduce(src[a:b]), src.size, tries, threads) / 1e9


def _best_split(work: Callable[[int, int], Any], size: int, tries: int, threads: int | None) -> float:
    """Best wall time of ``work`` over [0, size) split into one part per thread (numpy releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or os.cpu_count() or 1
    edges = np.linspace(0, size, threads + 1).astype(int)
    parts = list(zip(edges[:-1], edges[1:]))
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(tries):
            t0 = time.perf_counter()
            list(pool.map(lambda p: work(*p), parts))
            best = min(best, time.perf_counter() - t0)
    return best


GATHERS = ("Gather", "GatherBlockQuantized")  # ops that read rows of their tables (input 1: the indices)


def bytes_per_step(artifact_dir: Path, manifest: Manifest, rows: int = 1) -> int:
    """Weight bytes one decode step reads: Gather-only tables count ``rows`` rows, the rest in full,
    except a MoE layer's experts (``*.experts.*``): of its E experts a step reads at most ``k * rows``
    (the active parameters; the floor a MoE decode is held to)."""
    import onnx

    graph = onnx.load(str(artifact_dir / manifest.graphs["decode"].file), load_external_data=False).graph
    experts, active = manifest.model.experts
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for pos, name in enumerate(node.input):
            uses.setdefault(name, []).append((node.op_type, pos))
    total = 0
    for t in graph.initializer:
        size = _initializer_bytes(t)
        consumers = uses.get(t.name, [])
        if consumers and all(op in GATHERS and pos != 1 for op, pos in consumers) and t.dims:
            size = size // int(t.dims[0]) * rows
        elif ".experts." in t.name and experts:
            size = size * min(experts, active * rows) // experts
        total += size
    return total


def _initializer_bytes(t: Any) -> int:
    info = {e.key: e.value for e in t.external_data}
    if "length" in info:
        return int(info["length"])
    return len(t.raw_data) if t.raw_data else 0
