"""Bounded, checked command-line inputs: prompt files and stdin, text from argv, output paths.

A prompt holds at most ``max_seq`` tokens, so a prompt file is read up to ``max_seq *
BYTES_PER_TOKEN`` bytes and refused beyond (``/dev/zero`` and a 50 MB file end in one line, not
in a MemoryError or a tokenizer abort). Text must be UTF-8: an undecodable byte is a clear error
naming its offset (argv bytes that are not UTF-8 reach Python as lone surrogates and are refused
the same way). Output paths (``--json``, ``--plot``) are checked before a long run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from decodert.errors import DecodertError

BYTES_PER_TOKEN = 256  # 64 characters of at most 4 UTF-8 bytes: far above any real token


def read_prompt_file(path: Path, max_seq: int, flag: str = "--prompt-file") -> str:
    """The file (or stdin for '-') as UTF-8 text, at most ``max_seq * BYTES_PER_TOKEN`` bytes."""
    limit = max_seq * BYTES_PER_TOKEN
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            if path.exists() and not path.is_file() and not path.is_fifo() and not path.is_char_device():
                raise DecodertError(f"cannot read {flag} {path}: not a file")
            with open(path, "rb") as f:
                data = f.read(limit + 1)
    except OSError as e:
        raise DecodertError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise DecodertError(f"{flag} {path} is longer than {limit:,} bytes, more than a prompt of at most "
                            f"{max_seq} tokens (--max-seq of the export) can hold")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodertError(f"{flag} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                            "convert it, e.g. iconv -f latin1 -t utf-8") from None


def line_reader(max_seq: int) -> Callable[[str], str]:
    """``input`` for the chat REPL, bounded: from a pipe or file a line is read up to ``max_seq *
    BYTES_PER_TOKEN`` bytes (``decodert chat < /dev/zero`` no longer grows without end), decoded
    as UTF-8 with a clear error; a terminal uses ``input`` (a person types the line)."""
    limit = max_seq * BYTES_PER_TOKEN

    def read(prompt: str) -> str:
        if sys.stdin.isatty():
            try:
                return argv_text(input(prompt), "the chat line") or ""
            except UnicodeDecodeError as e:
                raise DecodertError(f"the chat line is not UTF-8 text (byte 0x{e.object[e.start]:02x})") from None
        sys.stdout.write(prompt)
        sys.stdout.flush()
        raw = sys.stdin.buffer.readline(limit + 1)
        if not raw:
            raise EOFError
        if len(raw) > limit:
            raise DecodertError(f"a chat line on stdin is longer than {limit:,} bytes, more than a prompt of at most "
                                f"{max_seq} tokens can hold")
        try:
            return raw.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as e:
            raise DecodertError(f"a chat line on stdin is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                                f"{e.start})") from None

    return read


def argv_text(text: str | None, flag: str) -> str | None:
    """``text`` from the command line, refused when its bytes were not UTF-8 (lone surrogates)."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = os.fsencode(text[e.start])
        raise DecodertError(f"{flag} is not valid UTF-8 (byte 0x{raw[0]:02x} at character {e.start}); "
                            "pass UTF-8 text") from None
    return text


def check_output_path(path: Path | None, flag: str) -> None:
    """Fail before the work when ``path`` cannot be written: no such folder, not a folder, read-only."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise DecodertError(f"{flag} {path}: is a folder; give a file name")
    if not parent.is_dir():
        raise DecodertError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise DecodertError(f"{flag} {path}: not writable")
