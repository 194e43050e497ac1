"""The ``decodert`` command: export, inspect, build, generate, chat, run, embed, serve, verify, bench, cache.

One module per command in this package; each has ``add_parser(subparsers)``, which sets
``func(args) -> int`` (the exit code). Every DecodertError ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import signal
import sys

from decodert import __version__
from decodert.cli import bench, build, cache, chat, embed, export, generate, inspect, run, serve, verify
from decodert.errors import DecodertError, Terminated

COMMANDS = (export, inspect, build, generate, chat, run, embed, serve, verify, bench, cache)  # the order of `decodert --help`


DESCRIPTION = "Compile an LLM checkpoint (HF folder or GGUF) to ONNX / TensorRT graphs and run it."
EPILOG = """first run:
  decodert run smollm2 --prompt "What is the capital of France?"
  decodert run smollm2                      (interactive chat)
  decodert export model.gguf -o out/ && decodert generate out/ --prompt "Hello"
`decodert COMMAND --help` describes each command."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decodert", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"decodert {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DecodertError as e:
        print(f"decodert: error: {e}", file=sys.stderr)
        return e.exit_code
    except Terminated as e:  # SIGTERM / SIGHUP where a command cleans up as for SIGINT (export/artifact/destination.py)
        print(f"decodert: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("decodert: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
