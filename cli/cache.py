"""``decodert cache list|clear``: what ``decodert run`` keeps in $DECODERT_CACHE (default ~/.cache/decodert)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cache", help="list or delete the exports and downloads `decodert run` keeps",
                              description="The cache is $DECODERT_CACHE (default ~/.cache/decodert): artifacts/ "
                                          "(exports of `decodert run` and LLM.load), models/ and wheels/ (the "
                                          "downloaded SmolLM2). Other files there are never touched.")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="print every entry with its size").set_defaults(func=run_list)
    c = sub.add_parser("clear", help="delete the entries (the next `decodert run` exports or downloads again)")
    c.add_argument("--exports", action="store_true", help="delete only the exported artifacts, keep the downloads")
    c.set_defaults(func=run_clear)


def run_list(args: argparse.Namespace) -> int:
    from decodert.export.cache import listing

    print(listing())
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from decodert.export.cache import clear
    from decodert.export.fetch import cache_dir

    count, freed = clear(exports_only=args.exports)
    print(f"deleted {count} entries ({freed / 1e6:.1f} MB) from {cache_dir()}")
    return 0
