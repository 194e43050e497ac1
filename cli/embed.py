"""``decodert embed MODEL TEXT... | --file F``: unit vectors, one JSON line per text on stdout, or a .npy with -o.

    decodert embed out/qwen3-embedding "first text" "second text"
    decodert embed smollm2 --file texts.txt -o vectors.npy --dimensions 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from decodert.cli import common, inputs
from decodert.errors import DecodertError

FILE_TEXTS = 2048  # --file holds at most this many full-length texts' bytes


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("embed", help="embed texts with an exported model",
                              description="Unit vectors of texts (the model's pooling rule, L2-normalised): one JSON "
                                          "line per text ({\"index\", \"tokens\", \"embedding\"}) or a .npy [n, d] (-o).")
    p.add_argument("model", metavar="MODEL", help=common.MODEL_HELP)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    p.add_argument("--file", type=Path, help="one text per line ('-' = stdin); blank lines are skipped")
    p.add_argument("--dimensions", type=int, default=None,
                   help="fewer dimensions, renormalised (matryoshka models only; default: the full size)")
    p.add_argument("-o", "--out", type=Path, default=None, help="write the vectors as a .npy file instead")
    p.add_argument("--verify", choices=["fast", "full", "none"], default="fast", help="artifact file checks")
    p.set_defaults(func=run_embed)


def run_embed(args: argparse.Namespace) -> int:
    from decodert.runtime.embedding import Embedder

    if bool(args.texts) == bool(args.file):
        raise DecodertError("give the texts as arguments or --file FILE (one of them)")
    if args.out is not None and args.out.suffix != ".npy":
        raise DecodertError(f"-o {args.out}: the vectors are written as .npy; name the file *.npy")
    embedder = Embedder.open(common.artifact_of(args.model), args.verify)
    texts = [inputs.argv_text(t, "TEXT") for t in args.texts]
    if args.file is not None:
        data = inputs.read_prompt_file(args.file, embedder.max_seq * FILE_TEXTS, "--file")
        texts = [line for line in data.splitlines() if line.strip()]
        if not texts:
            raise DecodertError(f"--file {args.file} holds no text (blank lines are skipped)")
    ids = embedder.token_ids(texts)
    vectors = embedder.embed(ids, args.dimensions)
    if args.out is not None:
        try:
            np.save(args.out, vectors)
        except OSError as e:
            raise DecodertError(f"-o {args.out}: cannot write ({e.strerror or e})") from None
        print(f"wrote {vectors.shape[0]} vectors of {vectors.shape[1]} dimensions to {args.out}", file=sys.stderr)
        return 0
    for i, (x, v) in enumerate(zip(ids, vectors)):
        print(json.dumps({"index": i, "tokens": int(len(x)), "embedding": v.tolist()}))
    return 0
