"""gpt-oss's harmony format: a reply is a run of channel messages, split into reasoning and content.

    <|channel|>analysis<|message|>I should ...<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

The ``analysis`` channel is the reasoning; the ``final`` channel is the content; a ``commentary``
message (a preamble, or a tool call ``to=functions.name``) is kept as content, markup and all:
harmony tool calls are not parsed into ``tool_calls`` yet. A reply with no markup is all content.

The markup tokens are special tokens of the harmony tokenizer, which decoding skips; for a model
whose chat template speaks harmony, ``markup_decoder`` keeps them in the decoded text (the reply of
``generate`` shows them too) so that ``HarmonyOutput`` can split it, whole or streamed, into the
same deltas as runtime/chat/output.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from decodert.runtime.chat.output import Delta, _held

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
STOPS = ("<|end|>", "<|return|>", "<|call|>")
MARKUP = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


def speaks_harmony(template: str | None) -> bool:
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


class MarkupDecoder:
    """A tokenizer's ``decode`` that keeps the harmony markup tokens (other special tokens still skipped)."""

    def __init__(self, tokenizer: Any, keep: set[int]) -> None:
        self._tok, self._keep = tokenizer, keep
        self._special = {int(i) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special} - keep

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if int(i) not in self._special]
        return self._tok.decode(list(ids), skip_special_tokens=False)


def markup_decoder(tokenizer: Any, template: str | None) -> Any:
    """``tokenizer`` itself, or for a harmony template a decoder that keeps the markup in the text."""
    if not speaks_harmony(template):
        return tokenizer
    keep = {tokenizer.token_to_id(m) for m in MARKUP} - {None}
    return MarkupDecoder(tokenizer, keep) if keep else tokenizer  # type: ignore[arg-type]


@dataclass
class HarmonyOutput:
    """Reply text (fed as it streams) -> reasoning / content deltas; the same interface as ChatOutput."""

    _buf: str = ""
    _state: str = "header"  # header (role, channel up to <|message|>) | body
    _kind: str = "content"  # where the current message's body goes
    _markup: bool = False  # a channel header was seen: the reply speaks harmony
    _out: list[Delta] = field(default_factory=list)

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        self._out = []
        while self._step(final=False):
            pass
        return self._out

    def finish(self) -> list[Delta]:
        self._out = []
        while self._step(final=True):
            pass
        if self._buf:
            self._send(self._kind if self._state == "body" else "content", self._buf)
            self._buf = ""
        return self._out

    def _send(self, kind: str, text: str) -> None:
        if text:
            self._out.append(Delta(kind, text))

    def _step(self, final: bool) -> bool:
        """Consume what can be decided in the buffer; True while progress is made."""
        if self._state == "header":
            at = self._buf.find(MESSAGE)
            if at < 0:
                head = self._buf.lstrip()
                markup_ahead = head.startswith("<|") or any(m.startswith(head) for m in MARKUP)
                if head and not markup_ahead and not self._markup:  # no harmony markup: plain content
                    self._state, self._kind = "body", "content"
                    return True
                return False
            header = self._buf[:at]
            channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else "final"
            self._kind = "reasoning" if channel == "analysis" else "content"
            self._markup, self._state, self._buf = True, "body", self._buf[at + len(MESSAGE):]
            return True
        cut = min(((self._buf.find(s), s) for s in STOPS if s in self._buf), default=None)
        if cut is None:
            keep = 0 if final else _held(self._buf, MARKUP)
            self._send(self._kind, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        at, stop = cut
        self._send(self._kind, self._buf[:at])
        self._buf, self._state = self._buf[at + len(stop):], "header"
        if self._buf.startswith(START):
            self._buf = self._buf[len(START):]
        return True
