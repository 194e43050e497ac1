"""gpt-oss's harmony format: a reply is a run of channel messages, split into reasoning and content.

    <|channel|>analysis<|message|>I should ...<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

The ``analysis`` channel is the reasoning; the ``final`` channel is the content. A message addressed to
a tool is a tool call when the request has tools (``HarmonyOutput(tools=True)``): its recipient is the
function, its body the arguments, up to ``<|call|>`` (or the end of the output):

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
     to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>   (recipient first)

-> ``Delta("tool")`` with the name ``get_weather`` (``functions.`` dropped), then the arguments as they
stream: the same deltas ChatOutput gives for other templates, so LLM.chat, stream_chat and the server
return OpenAI ``tool_calls``. Other commentary (a preamble) is content. The template renders earlier
calls and tool results back in harmony (gpt-oss's does: ``<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>{...}<|call|>`` and ``<|start|>functions.NAME to=assistant<|channel|>commentary
<|message|>...<|end|>``). A reply with no markup is all content.

The markup tokens are special tokens of the harmony tokenizer, which decoding skips; for a model
whose chat template speaks harmony, ``markup_decoder`` keeps them in the decoded text (the reply of
``generate`` shows them too) so that ``HarmonyOutput`` can split it, whole or streamed, into the
same deltas as runtime/chat/output.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from decodert.runtime.chat.output import Delta, _held, new_call_id

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
STOPS = ("<|end|>", "<|return|>", "<|call|>")
MARKUP = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


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

    tools: bool = False  # the request has tools: a message to a recipient is a tool call
    _buf: str = ""
    _state: str = "header"  # header (role, channel up to <|message|>) | body
    _kind: str = "content"  # where the current message's body goes
    _markup: bool = False  # a channel header was seen: the reply speaks harmony
    _calls: int = 0  # tool calls announced so far (the current one, in a "tool" body, is _calls - 1)
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
            self._out.append(Delta(kind, text, self._calls - 1) if kind == "tool" else Delta(kind, text))

    def _open(self, header: str) -> None:
        """A message header (up to <|message|>) decides where its body goes."""
        channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else "final"
        recipient = RECIPIENT.search(header)
        if self.tools and recipient:  # a call: the body is the arguments
            name = recipient.group(1).removeprefix("functions.")
            self._out.append(Delta("tool", "", self._calls, new_call_id(), name))
            self._calls += 1
            self._kind = "tool"
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"

    def _step(self, final: bool) -> bool:
        """Consume what can be decided in the buffer; True while progress is made."""
        if self._state == "header":
            at = self._buf.find(MESSAGE)
            if at < 0:
                head = self._buf.lstrip()
                markup_ahead = head.startswith(("<|", "to=")) or any(m.startswith(head) for m in (*MARKUP, "to="))
                if head and not markup_ahead and not self._markup:  # no harmony markup: plain content
                    self._state, self._kind = "body", "content"
                    return True
                return False
            self._open(self._buf[:at])
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
