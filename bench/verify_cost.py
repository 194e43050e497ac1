"""What a speculative verify pass costs against a decode step, on one artifact (ONNX Runtime).

    python bench/verify_cost.py ARTIFACT [--rows 1,4] [--widths 2,3,5,9] [--cached 200] [--repeats 15]

Fills ``rows`` cache slots with ``--cached`` random tokens each, then times (median of
``--repeats``, the cache length set back after every call) a decode step of those rows and a
verify pass of ``w`` tokens per row for each width, and prints each as a multiple of the decode
step. Then it alternates a decode step and a 5-token verify, the way speculative decoding runs
them, and prints both against their times alone (the sessions must not slow each other down).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 5, 9])
    p.add_argument("--cached", type=int, default=200)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    from decodert.runtime.llm import LLM

    be = LLM.load(args.artifact, backend="ort").backend
    rng = np.random.default_rng(0)
    for rows in args.rows:
        cache, slots = be.allocate(), list(range(rows))
        for s in slots:
            be.prefill(cache, [s], [rng.integers(3, be.vocab_size, args.cached)], False)
        start = cache.lengths.copy()

        def timed(call) -> float:
            t0 = time.perf_counter()
            call()
            for s in slots:
                cache.rewind(s, int(start[s]))
            return time.perf_counter() - t0

        decode = lambda: be.decode(cache, slots, np.full(rows, 5, np.int64), False)  # noqa: E731
        verify = lambda w: (lambda: be.verify(cache, slots, [np.arange(5, 5 + w)] * rows, False))  # noqa: E731
        for _ in range(3):  # warm-up: sessions, shapes
            timed(decode), timed(verify(5))
        med = lambda call: 1e3 * statistics.median(timed(call) for _ in range(args.repeats))  # noqa: E731
        d = med(decode)
        costs = {w: med(verify(w)) for w in args.widths}
        widths = "  ".join(f"w{w} {ms:.2f} ms ({ms / d:.2f}x)" for w, ms in costs.items())
        print(f"rows {rows}: decode {d:.2f} ms  {widths}", flush=True)
        v5 = med(verify(5))
        pairs = [(timed(decode), timed(verify(5))) for _ in range(args.repeats)]
        print(f"rows {rows}: alternating decode / verify w5 {1e3 * statistics.median(a for a, _ in pairs):.2f} / "
              f"{1e3 * statistics.median(b for _, b in pairs):.2f} ms (alone {d:.2f} / {v5:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
