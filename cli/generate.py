"""``decodert generate OUT --prompt TEXT``: stream a completion to stdout (or print --json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from decodert.cli import common, inputs
from decodert.cli.chat import add_image_flag, media, user_message


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text from an exported model",
                              description="Stream a completion of --prompt to stdout (or print --json).")
    p.add_argument("out", metavar="MODEL", type=Path, help=common.MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file ('-' = stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_image_flag(p)  # --image FILE: implies --chat
    common.add_common(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    prompt = inputs.argv_text(args.prompt, "--prompt")
    llm = common.load(args.out, args.backend, args.verify, common.draft_of(args), args.placement)
    if prompt is None:  # bounded by the artifact's max_seq, so it is read after loading
        prompt = inputs.read_prompt_file(args.prompt_file, llm.max_seq)
    messages = [user_message(prompt, media(args))] if args.chat or args.image else None
    return answer(llm, prompt, messages, args)


def answer(llm, prompt: str, messages: list | None, args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Generate once: print JSON, or stream text to stdout and a metrics line to stderr."""
    out = out or sys.stdout
    kw = common.sampling_kwargs(args)
    if args.json:
        result = llm.chat(messages, **kw) if messages else llm.generate(prompt, **kw)
        print(json.dumps(result.to_dict(), ensure_ascii=False), file=out)
        return 0
    stream = llm.stream_chat(messages, **kw) if messages else llm.stream(prompt, **kw)
    common.print_stream(stream, out)
    out.write("\n")
    common.print_stats(args, stream)
    return 0
