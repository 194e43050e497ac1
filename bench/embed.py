"""Embedding speed: ``LLM.embed`` on texts of a few lengths and batch sizes, medians of --repeats after one warm call.

    python bench/embed.py ~/.cache/decodert/artifacts/SmolLM2-...-ort-fp32-2048 --threads 2

The artifact must hold ``embed.onnx`` (``decodert export --embeddings``, or any cache export of `run` / `serve`).
Texts are random words from a fixed list (seeded), so the token counts are the same every run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

WORDS = "the cache keeps keys and values of earlier positions so each step only computes one token".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="1x128,8x128,4x512", help="ROWSxWORDS, comma-separated")
    args = parser.parse_args()
    os.environ["DECODERT_THREADS"] = str(args.threads)  # every ONNX Runtime session of the process
    from decodert import LLM

    llm = LLM.load(args.artifact)
    rng = np.random.default_rng(0)
    for case in args.cases.split(","):
        rows, words = (int(x) for x in case.split("x"))
        texts = [" ".join(rng.choice(WORDS, words)) for _ in range(rows)]
        llm.embed(texts)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            vectors = llm.embed(texts)
            times.append(time.perf_counter() - t)
        tokens = sum(len(llm.tokenizer.encode(x).ids) for x in texts)
        m = statistics.median(times)
        print(f"{rows} x {words} words ({tokens} tokens): {m * 1000:.0f} ms ({min(times) * 1000:.0f}-"
              f"{max(times) * 1000:.0f}), {tokens / m:.0f} tok/s, {vectors.shape[1]} dims, "
              f"norms {np.linalg.norm(vectors, axis=1).min():.6f}")


if __name__ == "__main__":
    main()
