"""Streaming text: an incremental UTF-8-safe detokenizer and a stop-string matcher.

Both hold text back rather than emit something that may change: the detokenizer holds an
incomplete multi-byte character (decoded as U+FFFD), the stop matcher holds a tail that could
be the start of a stop string. Each has ``push`` (-> newly safe text) and ``flush`` (-> the rest).
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the first generated one (leading-space rules)
MAX_HELD_TOKENS = 8  # a UTF-8 character spans <= 4 byte tokens: longer holds are invalid bytes, emitted


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas, decoding a sliding window of ids.

    The window starts a few tokens before the unread ones, so tokenizers whose decoding depends
    on the previous token (SentencePiece leading spaces, byte-level BPE) decode them as they
    would in the full sequence. A delta is emitted only when the window's text grows and does not
    end in U+FFFD (an incomplete UTF-8 character split across tokens).
    """

    def __init__(self, tokenizer: Decoder, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = [int(t) for t in context[-CONTEXT_TOKENS:]]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this have been emitted as text

    def _window_texts(self) -> tuple[str, str]:
        done = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        full = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        return done, full

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete ("" while a character is split)."""
        self._ids.append(int(token_id))
        done, full = self._window_texts()
        held_too_long = len(self._ids) - self._read > MAX_HELD_TOKENS
        if len(full) <= len(done) or (full.endswith(REPLACEMENT) and not held_too_long):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done):]

    def flush(self) -> str:
        """Return what is still held back, less a trailing incomplete character (it can never complete)."""
        done, full = self._window_texts()
        self._prefix = self._read = len(self._ids)
        return full[len(done):].rstrip(REPLACEMENT) if len(full) > len(done) else ""


class StopMatcher:
    """Find stop strings in streamed text, across delta boundaries.

    ``push(text)`` returns ``(safe_text, stopped)``: ``safe_text`` never includes a stop string or
    anything after it, and holds back the longest tail that is a prefix of some stop string.
    ``matched``: the stop string found (the earliest in the text; of two there, the longer), else None.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        pending = self._held + text
        found = [(i, -len(s), s) for s in self._stops if (i := pending.find(s)) >= 0]
        if found:
            cut, _, self.matched = min(found)
            self._held, self.stopped = "", True
            return pending[:cut], True
        keep = self._partial_tail(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], False

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = min(len(text), max(len(s) for s in self._stops) - 1)
        for n in range(longest, 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def flush(self) -> str:
        """Release the held tail (generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
