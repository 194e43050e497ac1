"""What the model-running commands (generate, chat, run) share: sampling flags, loading, streaming."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from decodert.errors import DecodertError

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.9


def add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    """Sampling flags, --backend, --full-verify, --json and --no-stats."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help=f"default {DEFAULT_TEMPERATURE}")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"nucleus mass (default {DEFAULT_TOP_P})")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S", help="stop strings")
    add_constraint(p)
    p.add_argument("--backend", choices=("auto", "ort", "trt"), default="auto", help="execution backend")
    p.add_argument("--full-verify", dest="verify", action="store_const", const="full", default="fast",
                   help="check the whole sha256 of every artifact file (default: size + first/last MiB)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--no-stats", dest="stats", action="store_false", help="no metrics line on stderr")


def add_constraint(p: argparse.ArgumentParser) -> None:
    """--json-schema FILE | --regex R | --grammar FILE (structured output, docs/STRUCTURED.md)."""
    g = p.add_argument_group("structured output (docs/STRUCTURED.md)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", type=Path, metavar="FILE", help="the output is JSON valid under this JSON schema")
    g.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    g.add_argument("--grammar", type=Path, metavar="FILE", help="the output follows this Lark grammar (llguidance syntax)")


def constraint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """{"json_schema": text} | {"regex": R} | {"grammar": text} | {} from the flags (files read here)."""
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    for flag, name in (("--json-schema", "json_schema"), ("--grammar", "grammar")):
        path = getattr(args, name, None)
        if path is not None:
            try:
                return {name: path.read_text(encoding="utf-8")}
            except (OSError, UnicodeDecodeError) as e:
                raise DecodertError(f"cannot read {flag} {path}: {getattr(e, 'strerror', None) or e}") from None
    return {}


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The generation keyword arguments of ``LLM.generate`` from parsed CLI arguments."""
    return {"max_new_tokens": args.max_new_tokens, "temperature": 0.0 if args.greedy else args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed, "stop": list(args.stop),
            **constraint_kwargs(args)}


def load(path: Path, backend: str, verify: str = "fast"):
    """``LLM.load`` (imported here so that ``decodert --help`` never loads onnxruntime)."""
    from decodert.runtime.llm import LLM

    return LLM.load(path, backend=backend, verify=verify)


def print_stream(stream, out: TextIO) -> None:
    for delta in stream:
        out.write(delta)
        out.flush()


def print_stats(args: argparse.Namespace, stream) -> None:
    if args.stats and stream.result is not None:
        print(stream.result.metrics.summary(), file=sys.stderr)
