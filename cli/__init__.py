"""The ``decodert`` command: export, inspect, build, generate, chat, run, serve, verify, bench.

One module per command in this package; each has ``add_parser(subparsers)``, which sets
``func(args) -> int`` (the exit code). Every DecodertError ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from decodert import __version__
from decodert.cli import bench, build, chat, export, generate, inspect, run, serve, verify
from decodert.errors import DecodertError

COMMANDS = (export, inspect, build, generate, chat, run, serve, verify, bench)  # the order of `decodert --help`


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decodert", description=__doc__.splitlines()[0])
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
    except KeyboardInterrupt:
        print("decodert: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
