"""Decode b1 tok/s of the ort decode step against decodert's own C step (placement's ``native-cpu``) on one artifact,
alternated in one process, and the bandwidth floor (issue 47).

    python bench/native_decode.py ART [--threads 2] [--prompt-len 128] [--gen 128] [--rounds 5] [--passes 1,2,4,8]

One OrtBackend opens the artifact; each round prefills the same prompt (pseudo-random ids, seed 0) on ort and runs
``--gen`` greedy decode steps on ort, then the same on the native step (``backend.place("decode", ...)``), so both
see the same load; prints each side's median tok/s (steps / their summed wall time), the ratio, whether the greedy
tokens were the same, and the floor: the weight bytes one step reads (``decodert.tools.bandwidth.bytes_per_step``:
the decode graph's initializers as stored; and the native step's packed copy) over the measured memory read
bandwidth with the same threads (``memread_gbps``).

``--passes N,..`` adds what one native call costs for more tokens: a verify of N tokens of one row (the row's ids at
its next positions), and a decode of N rows (one token each, up to the artifact's max_batch) on the native step and
on the ort session, each the median of 12 calls after a 128-token prompt per row, medians over the rounds.
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


def passes(backend: OrtBackend, sizes: list[int], rounds: int) -> None:
    """Milliseconds of one call: a verify of n tokens of a row on the native step; a decode of n rows on both."""
    native = backend.phase_sessions["native-cpu"]["decode"]
    rng = np.random.default_rng(1)
    vocab = native.recipe.vocab

    def prefilled(rows: int):
        cache = backend.allocate(rows)
        for s in range(rows):
            backend.prefill(cache, [s], [rng.integers(100, vocab - 100, 128)], False)
        return cache

    def timed(call) -> float:
        spent = []
        for _ in range(12):
            t = time.perf_counter()
            call()
            spent.append(time.perf_counter() - t)
        return statistics.median(spent) * 1e3

    ms: dict[str, list[float]] = {}
    for _ in range(rounds):
        for n in sizes:
            cache = prefilled(1)

            def verify(cache=cache, n=n):
                ids = rng.integers(100, vocab - 100, n)
                with cache.writing([0]):
                    native.forward(cache, [0], [ids])
                    cache.commit([0], [ids])

            ms.setdefault(f"verify of {n} tokens, native-cpu", []).append(timed(verify))
            if n <= backend.max_batch:
                for name in ("native-cpu", "ort"):
                    backend.place("decode", name)
                    cache = prefilled(n)
                    ms.setdefault(f"decode of {n} rows, {name}", []).append(
                        timed(lambda cache=cache, n=n: backend.decode(cache, list(range(n)), rng.integers(100, vocab - 100, n), False)))
    for what, v in ms.items():
        print(f"{what:32s} {statistics.median(v):7.2f} ms  (rounds: {', '.join(f'{x:.2f}' for x in v)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--passes", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="also time one call of N verify tokens / N decode rows")
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
    if args.passes:
        passes(backend, args.passes, max(args.rounds, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
