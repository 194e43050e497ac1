"""``decodert inspect OUT``: print an artifact's manifest and graph summary."""

from __future__ import annotations

import argparse
from typing import Any

from decodert.cli import common


def add_parser(sub: Any) -> None:
    i = sub.add_parser("inspect", help="print an artifact's manifest and graph summary",
                       description="Print what an artifact holds: the model, target, dtype and quantization (bits, "
                                   "block size, accuracy level, symmetric), max_seq / max_batch, the sampling "
                                   "defaults, each graph's ops and I/O, the engines and the files.")
    i.add_argument("out", metavar="MODEL", help=common.MODEL_HELP)
    i.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from decodert.export.artifact.inspect import inspect_artifact

    from decodert.runtime.backends.placement import describe_artifact

    folder = common.artifact_of(args.out)
    print(inspect_artifact(folder))
    placed = describe_artifact(folder)  # runtime/backends/placement.py: the choice measured at a load
    if placed is not None:
        print(f"placement: {placed}")
    return 0
