"""Where a decodert decode step (or prefill) spends its time, by ONNX Runtime's own profiler.

    python bench/ort_profile.py ARTIFACT [--batch 1] [--prompt-len 128] [--steps 64] [--threads 2] [--prefill]

Opens the artifact with ``SessionOptions.enable_profiling``, runs one request (``--prompt-len``
prompt, ``--steps`` decode steps), and sums the profiler's kernel events by op type: the time per
step of each op kind, its share, and the step's total next to the wall time (the rest is the
session's own overhead: binding, thread pool hand-offs, Python).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from decodert.runtime.backends.ort import backend as ort_backend
from decodert.runtime.backends.loading import read_manifest
from decodert.tools import bench as B


def profiled_backend(folder: Path, threads: int, prefix: str) -> ort_backend.OrtBackend:
    plain = ort_backend.session_options

    def with_profiling(t):
        so = plain(t)
        so.enable_profiling = True
        so.profile_file_prefix = prefix
        return so

    ort_backend.session_options = with_profiling
    try:
        return ort_backend.OrtBackend(folder, read_manifest(folder), threads=threads)
    finally:
        ort_backend.session_options = plain


def by_op(trace: Path, skip_runs: int) -> tuple[dict[str, float], int]:
    """Microseconds per op type summed over the model runs after the first ``skip_runs``; and the runs counted."""
    events = json.loads(trace.read_text())
    runs = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    if len(runs) <= skip_runs:
        return {}, 0
    start = runs[skip_runs]
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            totals[e["args"]["op_name"]] += e["dur"]
    return totals, len(runs) - skip_runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", action="store_true", help="profile prefill calls instead of decode steps")
    p.add_argument("--out", type=Path, default=Path("/tmp"), help="where the profiler's JSON goes")
    args = p.parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        print(f"decodert: error: {args.artifact} is not an artifact folder", file=sys.stderr)
        return 2
    os.environ["DECODERT_THREADS"] = str(args.threads)
    be = profiled_backend(args.artifact, args.threads, str(args.out / f"ortprof-{os.getpid()}"))
    runner = B.BackendRunner(be, args.batch)
    ids = B.prompt_ids(be.vocab_size, args.prompt_len)
    runner.run(ids, 4)  # warm-up: 1 prefill + 3 decode runs
    t0 = time.perf_counter()
    timing = runner.run(ids, args.steps + 1)
    wall = time.perf_counter() - t0
    trace = Path(be.sessions["prefill"].end_profiling())
    # warm-up: runs 0-3; the timed request: its prefill is run 4, its decode steps runs 5 on
    totals, runs = _first_run(trace, 4) if args.prefill else by_op(trace, 5)
    calls = max(runs, 1)
    step_ms = 1e3 * (timing.prefill_s if args.prefill else float(timing.step_s.mean()))
    total = sum(totals.values()) / calls / 1e3
    print(f"{args.artifact.name}: {'prefill' if args.prefill else 'decode'} batch {args.batch}, {args.threads} threads: "
          f"{step_ms:.2f} ms per call (wall), kernels {total:.2f} ms ({runs} runs profiled, {wall:.1f} s)")
    for op, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        ms = us / calls / 1e3
        print(f"  {op:<36} {ms:8.3f} ms {100 * ms / max(total, 1e-9):5.1f}%")
    return 0


def _first_run(trace: Path, skip_runs: int) -> tuple[dict[str, float], int]:
    """Op times of the one model run after ``skip_runs`` (the timed prefill)."""
    events = json.loads(trace.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    lo, hi = runs[skip_runs]
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and lo <= e["ts"] <= hi:
            totals[e["args"]["op_name"]] += e["dur"]
    return totals, 1


if __name__ == "__main__":
    sys.exit(main())
