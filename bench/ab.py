"""A/B of decode step time between decodert artifacts, each run in its own process, alternating.

    python bench/ab.py ART_A ART_B [ART_C ...] [--rounds 4] [--batch 1] [--prompt-len 128] [--gen 128]

Every round runs each artifact once, in a fresh process (so no artifact's ONNX Runtime thread
pool spins while another is timed): load, then 3 greedy requests of ``--prompt-len`` prompt and
``--gen`` tokens, timing every decode step. The first request is a warm-up. A round reports the
median step time, and the summary is the median of the rounds' medians. This is how the
optimisation log in docs/benchmarks/history.md compares graph variants on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_run(artifact: str, batch: int, prompt_len: int, gen: int) -> float:
    """In the worker: median decode step (ms) over the timed requests."""
    from decodert.tools import bench as B
    from decodert.runtime.backends.loading import open_backend, read_manifest

    folder = Path(artifact)
    manifest = read_manifest(folder)
    runner = B.BackendRunner(open_backend(folder, manifest, "ort"), batch)
    ids = B.prompt_ids(manifest.model.vocab_size, prompt_len)
    runs = [runner.run(ids, gen) for _ in range(3)][1:]
    return 1e3 * statistics.median([float(s) for r in runs for s in r.step_s])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(one_run(args.artifacts[0], args.batch, args.prompt_len, args.gen)))
        return 0
    rounds: dict[str, list[float]] = {a: [] for a in args.artifacts}
    for r in range(args.rounds):
        for a in args.artifacts:
            cmd = [sys.executable, __file__, a, "--worker", "--batch", str(args.batch),
                   "--prompt-len", str(args.prompt_len), "--gen", str(args.gen)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{a}: worker failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
                return 1
            rounds[a].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done at {time.strftime('%H:%M:%S')}", flush=True)
    for a, ms in rounds.items():
        runs = " ".join(f"{m:.2f}" for m in ms)
        print(f"{a}: median of medians {statistics.median(ms):.2f} ms per step at batch {args.batch} (rounds: {runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
