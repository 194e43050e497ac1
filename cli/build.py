"""``decodert build OUT``: TensorRT engines (prefill.engine, decode.engine) from an exported artifact folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodert.cli import common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``decodert build OUT [--fp16|--bf16] [--max-batch N] [--max-seq N] ...``."""
    p: argparse.ArgumentParser = subparsers.add_parser("build", help="build TensorRT engines from an exported artifact folder",
                              description="Build OUT/prefill.engine and OUT/decode.engine (TensorRT or TensorRT-RTX); "
                                          "for a Whisper artifact OUT/encoder.engine and OUT/decoder.engine.")
    p.add_argument("out", type=Path, help="artifact folder (exported with --target trt)")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help="expect fp16 graphs")
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="expect bf16 graphs")
    p.add_argument("--max-batch", type=int, default=None, help="largest batch (default: manifest max_batch)")
    p.add_argument("--max-seq", type=int, default=None, help="longest prefill (default: manifest max_seq)")
    p.add_argument("--version-compatible", action="store_true", help="engines a newer TensorRT of the same major can run")
    p.add_argument("--timing-cache", type=Path, default=None, help="load/save the builder timing cache here")
    p.add_argument("--self-contained", action="store_true",
                   help="embed the weights in every engine (each engine then holds a copy of weights.bin); by "
                        "default engines are weight-stripped where TensorRT can (a GPU present) and refitted from "
                        "the ONNX graphs' weights.bin at load")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--full-verify", dest="verify", action="store_const", const="full", default="fast",
                   help="check the whole sha256 of every artifact file first (default: size + first/last MiB)")
    p.set_defaults(func=run_build)
    return p


def run_build(args: argparse.Namespace) -> int:
    from decodert.export.trt_build import build_engines

    from decodert.export.trt_build import load_trt, strip_problem

    from decodert.artifact.seq2seq import is_seq2seq_artifact
    from decodert.export.trt_seq2seq import build_seq2seq_engines

    common.artifact_only(args.out, "build")
    build = build_seq2seq_engines if is_seq2seq_artifact(args.out) else build_engines  # Whisper: encoder + decoder
    engines = build(args.out, precision=args.precision, max_batch=args.max_batch, max_seq=args.max_seq,
                    version_compatible=args.version_compatible, timing_cache=args.timing_cache,
                    progress=args.progress, verify=args.verify, self_contained=args.self_contained)
    for name, rec in engines.items():
        print(f"{rec.file}: {rec.size / 2**20:.1f} MiB in {rec.build_seconds:.1f} s "
              f"({rec.tensorrt['flavour']} {rec.tensorrt['version']}, {rec.precision}, "
              f"target {rec.target['compute_capability']}, "
              f"{'weights stripped' if rec.weights_stripped else 'weights embedded'})")
    weights = (args.out / "weights.bin").stat().st_size
    total = sum(rec.size for rec in engines.values())
    print(f"engines {total / 2**20:.1f} MiB + weights.bin {weights / 2**20:.1f} MiB = {(total + weights) / 2**20:.1f} MiB")
    if not args.self_contained and not any(rec.weights_stripped for rec in engines.values()):
        why = strip_problem(load_trt(need_builder=True)[0])
        print(f"weights embedded in each engine: {why}" if why else "weights embedded in each engine")
    return 0
