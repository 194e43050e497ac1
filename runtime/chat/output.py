"""A chat reply split as it streams: reasoning, content and tool calls.

    out = ChatOutput(fmt, think=True)          # fmt: runtime/chat/tool_calls.py ToolFormat, or None (no tools)
    for delta in out.feed(text): ...           # Delta("content" | "reasoning" | "tool", ...)
    deltas += out.finish()                     # at the end of the output
    content, reasoning, calls = assemble(deltas)

The same object reads a whole reply (one ``feed``) and a stream (many), so streamed deltas reassemble
to the non-streamed result. Text that could still become a marker (``<tool_`` at the end of what
arrived) is held back until it is decided; markup never reaches the content.

Reasoning: ``<think>...</think>`` at the start of the reply (Qwen3, SmolLM3), or from the start when
the prompt itself ends inside ``<think>`` (``in_think``). Tool calls: ``fmt.open`` ... ``fmt.close``
(or the end of the output), or the bare JSON at the start for formats whose marker is a special token.
A call's id is ``call_<24 hex>``; ``Delta("tool")`` carries its index, then id and name once, then
chunks of the arguments' JSON text as it is written.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from decodert.runtime.chat.tool_calls import ToolFormat, parse_whole, scan

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Delta:
    kind: str  # "content" | "reasoning" | "tool"
    text: str = ""  # content or reasoning text, or a chunk of a call's arguments
    index: int = 0  # the call's index (tool)
    id: str | None = None  # set on a call's first delta
    name: str | None = None  # set on a call's first delta


@dataclass
class _Call:
    id: str
    name: str
    sent: int = 0  # characters of the arguments already sent


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    for n in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


@dataclass
class ChatOutput:
    fmt: ToolFormat | None = None  # None: no tool calls are read
    think: bool = False  # read <think>...</think> as reasoning
    in_think: bool = False  # the prompt opened <think>: the reply starts as reasoning
    _buf: str = ""  # text not yet decided
    _state: str = "start"  # start | think | content | body | after
    _seen_text: bool = False  # content other than whitespace was sent
    _body: str = ""  # the current call body
    _calls: list[_Call] = field(default_factory=list)  # every call announced so far
    _base: int = 0  # calls announced before the current body
    _opened: str = ""  # the marker that opened the current body ("": a bare start)

    def __post_init__(self) -> None:
        if self.in_think:
            self._state = "think"

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self._state == "body":
            self._end_body(out)
        elif self._buf:
            out.append(Delta("reasoning" if self._state == "think" else "content", self._buf))
        self._buf = ""
        return [d for d in out if d.kind == "tool" or d.text]

    # -- the state machine: each step consumes part of _buf; False when it needs more text ----------
    def _step(self, out: list[Delta], final: bool) -> bool:
        state = self._state
        if state == "start":
            return self._start(final)
        if state == "think":
            return self._reason(out, final)
        if state == "body":
            return self._read_body(out, final)
        return self._content(out, final)

    def _start(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if self.think and stripped.startswith(THINK_OPEN):
            self._buf, self._state = stripped[len(THINK_OPEN):], "think"
            return True
        if self.think and THINK_OPEN.startswith(stripped) and stripped and not final:
            return False
        if self.fmt is not None and stripped and self.fmt.open.startswith(stripped[:len(self.fmt.open)]):
            if stripped.startswith(self.fmt.open) or final:  # the marker itself: read as in content
                self._buf, self._state = stripped, "content"
                return True
            return False
        if self.fmt is not None and self.fmt.bare and stripped[:1] == self.fmt.bare:
            self._buf, self._state, self._opened = stripped, "body", ""
            return True
        if not stripped and not final:
            return False  # only whitespace so far: the body or <think> may follow
        self._buf, self._state = stripped, "content"  # the reply's content starts at its first visible character
        return True

    def _reason(self, out: list[Delta], final: bool) -> bool:
        at = self._buf.find(THINK_CLOSE)
        if at < 0:
            keep = 0 if final else _held(self._buf, (THINK_CLOSE,))
            self._send(out, "reasoning", self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._send(out, "reasoning", self._buf[:at])
        self._buf, self._state = self._buf[at + len(THINK_CLOSE):].lstrip(), "start"
        self.think = False  # one reasoning block per reply
        return True

    def _content(self, out: list[Delta], final: bool) -> bool:
        if self.fmt is None:
            self._send(out, "content", self._buf)
            self._buf = ""
            return False
        at = self._buf.find(self.fmt.open)
        if at < 0:
            keep = 0 if final else _held(self._buf, (self.fmt.open,))
            text = self._buf[: len(self._buf) - keep]
            if self._state == "after" and not text.strip() and not final:  # whitespace between calls: wait
                return False
            self._send(out, "content", text if self._state != "after" or text.strip() else "")
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        before = self._buf[:at]
        self._send(out, "content", before if self._state != "after" or before.strip() else "")
        self._buf, self._state, self._body = self._buf[at + len(self.fmt.open):], "body", ""
        self._opened = self.fmt.open
        return True

    def _send(self, out: list[Delta], kind: str, text: str) -> None:
        if text:
            out.append(Delta(kind, text))
            self._seen_text = self._seen_text or (kind == "content" and bool(text.strip()))

    def _read_body(self, out: list[Delta], final: bool) -> bool:
        close = self.fmt.close if self.fmt else ""
        at = self._buf.find(close) if close else -1
        if at < 0:
            keep = 0 if final or not close else _held(self._buf, (close,))
            self._body += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            self._announce(out, scan(self.fmt, self._body))
            return False
        self._body += self._buf[:at]
        self._buf = self._buf[at + len(close):]
        self._end_body(out)
        self._state = "after"
        return True

    def _announce(self, out: list[Delta], partials: list) -> None:
        for k, p in enumerate(partials):
            index = self._base + k
            if index == len(self._calls):
                if p.name is None:
                    return
                self._calls.append(_Call(new_call_id(), p.name))
                out.append(Delta("tool", "", index, self._calls[index].id, p.name))
            call = self._calls[index]
            if len(p.arguments) > call.sent:
                out.append(Delta("tool", p.arguments[call.sent:], index))
                call.sent = len(p.arguments)

    def _end_body(self, out: list[Delta]) -> None:
        """A body is complete: read it once more as a whole (any key order); not calls -> content."""
        partials = scan(self.fmt, self._body)
        if not (partials and all(p.done for p in partials)) and len(self._calls) == self._base:
            partials = parse_whole(self.fmt, self._body) or partials
        self._announce(out, partials)
        if len(self._calls) == self._base:  # nothing was a call: the text is content
            self._send(out, "content", self._opened + self._body)
        self._base, self._body = len(self._calls), ""


def assemble(deltas: list[Delta]) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Deltas -> (content or None, reasoning or None, OpenAI tool_calls [{id, type, function: {name, arguments}}])."""
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d.kind != "tool":
            continue
        if d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        calls[d.index]["function"]["arguments"] += d.text
    return content or None, reasoning or None, calls
