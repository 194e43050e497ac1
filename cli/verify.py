"""``decodert verify OUT``: compare TensorRT engines with ONNX Runtime on the same graphs (needs a GPU)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodert.cli import common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``decodert verify OUT [--steps N] [--rows N] [--bench] [--batches 1,4]``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "verify", help="compare TensorRT engines with ONNX Runtime on the same graphs (needs a GPU)",
        description="Run the same prompts through the TensorRT engines (`decodert build`) and through ONNX Runtime on "
                    "the CPU, and report the logits' difference and the greedy tokens' agreement per step; exit 1 "
                    "below --min-agreement. --bench also times decode with and without CUDA graphs.")
    p.add_argument("out", type=Path, help="artifact folder exported with --target trt, engines built by `decodert build`")
    p.add_argument("--steps", type=int, default=16, help="decode steps to compare (default 16)")
    p.add_argument("--rows", type=int, default=2, help="prompts decoded together (default 2)")
    p.add_argument("--min-agreement", type=float, default=0.9, help="fail (exit 1) below this greedy agreement (default 0.9)")
    p.add_argument("--bench", action="store_true", help="also time decode with and without CUDA graphs")
    p.add_argument("--batches", default="1,4", help="batch sizes for --bench (default 1,4)")
    p.add_argument("--bench-steps", type=int, default=64, help="decode steps timed per batch size (default 64)")
    p.set_defaults(func=run_verify)
    return p


def run_verify(args: argparse.Namespace) -> int:
    from decodert.tools.verify import bench, format_report, verify

    common.artifact_only(args.out, "verify")
    result = verify(args.out, steps=args.steps, rows=args.rows)
    rows = bench(args.out, [int(b) for b in args.batches.split(",")], args.bench_steps) if args.bench else []
    print(format_report(result, rows))
    agreement = min(result["greedy_agreement"], result.get("verify_agreement", 1.0))
    return 0 if agreement >= args.min_agreement else 1
