"""``decodert chat OUT``: a streaming chat REPL (Ctrl-C stops an answer, /reset forgets, /exit or EOF quits)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from decodert.cli import common, inputs


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="interactive chat with an exported model",
                              description="Streaming chat REPL: Ctrl-C stops an answer, /reset forgets, "
                                          "/exit or EOF quits.")
    p.add_argument("out", type=Path, help="artifact folder written by `decodert export`")
    p.add_argument("--system", help="system message")
    common.add_common(p, json_flag=False)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    return chat_loop(common.load(args.out, args.backend, args.verify), args)


def chat_loop(llm, args: argparse.Namespace, read: Callable[[str], str] | None = None, out: TextIO | None = None) -> int:
    """The REPL: keeps the history; Ctrl-C stops the current answer; /reset forgets; /exit or EOF quits.
    ``read``: how a line is read (default: stdin, bounded by the model's max_seq; cli/inputs.py)."""
    out = out or sys.stdout
    read = read or inputs.line_reader(llm.max_seq)
    system = [{"role": "system", "content": inputs.argv_text(args.system, "--system")}] if getattr(args, "system", None) else []
    history: list[dict] = []
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            continue
        if text:
            history.append({"role": "user", "content": line})
            history.append({"role": "assistant", "content": _chat_turn(llm, system + history, args, out)})


def _chat_turn(llm, messages: list[dict], args: argparse.Namespace, out: TextIO) -> str:
    """Stream one answer; on Ctrl-C keep what was shown so far and return to the prompt."""
    stream = llm.stream_chat(messages, **common.sampling_kwargs(args))
    try:
        common.print_stream(stream, out)
    except KeyboardInterrupt:
        stream.close()
        out.write(" [interrupted]")
    out.write("\n")
    common.print_stats(args, stream)
    return stream.text
