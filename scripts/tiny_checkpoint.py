"""Write a tiny random HF checkpoint of one family, as the tests make them: a way to try a family without its weights.

    python scripts/tiny_checkpoint.py qwen3 /tmp/tiny-qwen3          # then: decodert run /tmp/tiny-qwen3 --prompt hi
    python scripts/tiny_checkpoint.py --list                         # the families it can write

The checkpoint is a few MB (2 layers, hidden size 64, a BPE tokenizer trained on a paragraph, random weights, seeded),
so its text is noise: it checks that a family exports and runs, never what it answers. Needs torch and transformers
(the `test` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # tests/helpers/tiny.py importable as a module, as conftest.py does


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", nargs="?", help="a model_type of tests/helpers/tiny.py (--list shows them)")
    parser.add_argument("out", nargs="?", help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="list the families and exit")
    args = parser.parse_args(argv)
    try:
        import tiny
    except ImportError as e:  # torch / transformers missing
        print(f"tiny_checkpoint: needs the test extra (pip install -e '.[test]'): {e}", file=sys.stderr)
        return 2
    families = sorted({**tiny.CONFIGS, **tiny.HYBRID_CONFIGS, **tiny.OWN_CONFIGS})
    if args.list:
        print("\n".join(families))
        return 0
    if args.family is None or args.out is None:
        parser.error("give a family and an output folder (or --list)")
    if args.family not in families:
        print(f"tiny_checkpoint: unknown family {args.family!r}; choose from {', '.join(families)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"tiny_checkpoint: {out} already exists and is not an empty folder", file=sys.stderr)
        return 2
    tiny.make_tiny_checkpoint(args.family, out, seed=args.seed)
    print(f"wrote a tiny random {args.family} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
