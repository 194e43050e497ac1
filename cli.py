"""The ``decodert`` command: export, inspect, build, generate, chat, run, bench.

Every DecodertError ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from decodert import __version__
from decodert.errors import DecodertError


def _export(args: argparse.Namespace) -> int:
    from decodert.export.pipeline import export_model

    m = export_model(args.src, args.out, target=args.target, dtype=args.dtype, max_seq=args.max_seq,
                     max_batch=args.max_batch)
    print(f"exported {m['model']['family']} ({m['target']}, {m['dtype']}, max_seq {m['max_seq']}) to {args.out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from decodert.export.inspect import inspect_artifact

    print(inspect_artifact(args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decodert", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"decodert {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="convert a checkpoint (HF folder or .gguf) to prefill/decode ONNX graphs")
    e.add_argument("src", help="Hugging Face model folder or GGUF file")
    e.add_argument("-o", "--out", required=True, help="artifact folder to write")
    e.add_argument("--target", choices=["ort", "trt", "portable"], default="ort")
    e.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
    e.add_argument("--max-seq", type=int, default=None, help="tokens per sequence the cache holds (default: min(context, 2048))")
    e.add_argument("--max-batch", type=int, default=4, help="sequences decoded together")
    e.set_defaults(func=_export)

    i = sub.add_parser("inspect", help="print an artifact's manifest and graph summary")
    i.add_argument("out")
    i.set_defaults(func=_inspect)

    for module, attr in (("decodert.export.trt_build", "add_parser"), ("decodert.runtime.cli_run", "add_parsers"),
                         ("decodert.runtime.verify", "add_parser"), ("decodert.runtime.bench", "add_parser")):
        try:
            mod = __import__(module, fromlist=[attr])
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        getattr(mod, attr)(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DecodertError as e:
        print(f"decodert: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("decodert: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
