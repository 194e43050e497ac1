"""Per-token cost of the sampling path on the host (runtime/decoding/sampling.py): penalties + sampler on
one row of logits [1, V], as the loop runs them when the graph's argmax cannot be used.

    python bench/sampling.py [--vocab 49152] [--module path/to/other/sampling.py]

``--module`` times another version of the file (e.g. ``git show REV:runtime/decoding/sampling.py``) with
the same cases, for before/after figures (docs/benchmarks/history.md, "Sampling on the host").
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
import types

import numpy as np

CASES = {  # name -> (make_sampler args, make_logits_processors args)
    "greedy + repetition 1.1, frequency 0.2": ((0.0,), (1.1, 0.0, 0.2)),
    "T 0.7, top_p 0.9": ((0.7, 0, 0.9, 0.0), (1.0, 0.0, 0.0)),
    "T 0.7, top_k 40, min_p 0.05": ((0.7, 40, 1.0, 0.05), (1.0, 0.0, 0.0)),
    "T 0.7, top_p 0.9 + repetition 1.1": ((0.7, 0, 0.9, 0.0), (1.1, 0.0, 0.0)),
}


def load(path: str | None) -> types.ModuleType:
    if path is None:
        from decodert.runtime.decoding import sampling

        return sampling
    spec = importlib.util.spec_from_file_location("sampling_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--module", default=None, help="another sampling.py to time instead of the installed one")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    mod = load(args.module)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 5, (1, args.vocab)).astype(np.float32)  # [1, V]
    history = rng.integers(0, args.vocab, 300)  # [300]
    print(f"{args.module or 'runtime/decoding/sampling.py'}, V = {args.vocab}: microseconds per token (best of {args.repeats})")
    for name, (s_args, p_args) in CASES.items():
        sampler = mod.make_sampler(*s_args, rng=np.random.default_rng(1))
        procs = mod.make_logits_processors(*p_args)
        step = lambda: sampler(mod.apply_processors(procs, history, logits))  # noqa: E731
        best = min(timeit.repeat(step, number=100, repeat=args.repeats)) / 100 * 1e6
        print(f"  {name:40s} {best:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
