"""Decode b1 tok/s of the ort decode step against decodert's own C step (placement's ``native-cpu``) on one artifact,
alternated in one process, and the bandwidth floor (issue 47).

    python bench/native_decode.py ART [--threads 2] [--prompt-len 128] [--gen 128] [--rounds 5]

One OrtBackend opens the artifact; each round prefills the same prompt (pseudo-random ids, seed 0) on ort and runs
``--gen`` greedy decode steps on ort, then the same on the native step (``backend.place("decode", ...)``), so both
see the same load; prints each side's median tok/s (steps / their summed wall time), the ratio, whether the greedy
tokens were the same, and the floor: the weight bytes one step reads (``decodert.tools.bandwidth.bytes_per_step``:
the decode graph's initializers as stored; and the native step's packed copy) over the measured memory read
bandwidth with the same threads (``memread_gbps``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from decodert.artifact.manifest import load_manifest
from decodert.runtime.backends.ort.backend import OrtBackend
from decodert.tools.bandwidth import bytes_per_step, memread_gbps


def run(backend: OrtBackend, ids: np.ndarray, gen: int) -> tuple[list[int], float]:
    cache = backend.allocate(1)
    token = int(backend.prefill(cache, [0], [ids], False).next_token[0])
    tokens, spent = [token], 0.0
    for _ in range(gen):
        t = time.perf_counter()
        token = int(backend.decode(cache, [0], np.array([token], np.int64), False).next_token[0])
        spent += time.perf_counter() - t
        tokens.append(token)
    return tokens, gen / spent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    manifest = load_manifest(args.artifact)
    backend = OrtBackend(args.artifact, manifest, threads=args.threads)
    t = time.perf_counter()
    backend.place("decode", "native-cpu", args.threads)
    native = backend.phase_sessions["native-cpu"]["decode"]
    print(f"native step: opened in {time.perf_counter() - t:.1f} s, {native.packed_bytes / 1e6:.0f} MB packed, "
          f"{native.threads} threads")
    ids = np.random.default_rng(0).integers(100, manifest.model.vocab_size - 100, args.prompt_len)
    rates: dict[str, list[float]] = {"ort": [], "native-cpu": []}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds + 1):  # round 0 warms both up, not counted
        for name in rates:
            backend.place("decode", name, args.threads)
            got, rate = run(backend, ids, args.gen)
            if r:
                rates[name].append(rate)
            tokens.setdefault(name, got)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for name, v in rates.items():
        print(f"{name:11s} decode b1: median {med[name]:6.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in v)})")
    print(f"native / ort: x{med['native-cpu'] / med['ort']:.2f}; greedy tokens the same: {tokens['ort'] == tokens['native-cpu']}")
    read = memread_gbps(threads=args.threads)
    graph_bytes, packed = bytes_per_step(args.artifact, manifest), native.packed_bytes
    print(f"memory read: {read:.1f} GB/s with {args.threads} threads; a step reads {graph_bytes / 1e6:.0f} MB of the "
          f"graph's weights ({packed / 1e6:.0f} MB packed): floor {read * 1e9 / graph_bytes:.0f} tok/s "
          f"({read * 1e9 / packed:.0f} on the packed copy); native at {med['native-cpu'] * graph_bytes / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
