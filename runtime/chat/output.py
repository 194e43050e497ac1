"""A chat reply split as it streams: reasoning, content and tool calls.

    out = ChatOutput(fmt, think=True)          # fmt: runtime/chat/tool_calls.py ToolFormat, or None (no tools)
    for delta in out.feed(text): ...           # Delta("content" | "reasoning" | "tool", ...)
    deltas += out.finish()                     # at the end of the output
    content, reasoning, calls = assemble(deltas)
    out.repeated                               # a call repeated an earlier one: the turn is over (runtime/chat/turn.py)

The same object reads a whole reply (one ``feed``) and a stream (many), so streamed deltas reassemble
to the non-streamed result. Text that could still become a marker (``<tool_`` at the end of what
arrived) is held back until it is decided; markup never reaches the content: a marker begun when the
output ends, a body its close marker never closed, or a body that began like a call (``{"name"``) and
was cut, is dropped (its call, if its name was written, is returned with the arguments written so far).

Reasoning: ``<think>...</think>`` at the start of the reply (Qwen3, SmolLM3), or from the start when
the prompt itself ends inside ``<think>`` (``in_think``). A call marker inside the reasoning that opens
a call object (``<tool_call>{"name"``) ends the reasoning: models whose prompt opened ``<think>`` call
without closing it, and a constrained call is written from the reply's first token.

Tool calls: ``fmt.open`` ... ``fmt.close`` (or the end of the output), or the bare JSON at the start for
formats whose marker is a special token; for ``fmt.loose`` formats (hermes) a whole reply that is one
JSON object ``{"name": <a declared function>, "arguments": {...}}`` is that call (``names``: the
declared functions; such a reply is held back until it ends or stops looking like a call). A call's
id is ``call_<24 hex>``; ``Delta("tool")`` carries its index, then id and name once, then chunks of the
arguments' JSON text as it is written. The first call streams as it is written; a later one is sent
once it is complete, and one identical to an earlier call (same name, same arguments) ends the calls
(``repeated``): it and everything after it are dropped, as a small model repeats its call forever.

``echo``: the conversation holds tool results; the ``<tool_response>`` / ``</tool_response>`` tags a
model copies from them into its answer are removed from the content (with the whitespace after them).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from decodert.runtime.chat.tool_calls import Partial, ToolFormat, opens_call, parse_whole, scan, value_end

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ECHO_TAGS = ("<tool_response>", "</tool_response>")  # the wrapper tool results are rendered in (runtime/chat/tools.py)


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
    arguments: str = ""  # the arguments' JSON text sent so far


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    for n in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest of ``markers`` in ``text``; (-1, "") when none is."""
    found = [(text.find(m), m) for m in markers if m and m in text]
    return min(found) if found else (-1, "")


def _same(a: str, b: str) -> bool:
    """Two calls' arguments (JSON text) hold the same value."""
    try:
        return json.loads(a or "{}") == json.loads(b or "{}")
    except (json.JSONDecodeError, RecursionError, ValueError):
        return a == b


@dataclass
class ChatOutput:
    fmt: ToolFormat | None = None  # None: no tool calls are read
    think: bool = False  # read <think>...</think> as reasoning
    in_think: bool = False  # the prompt opened <think>: the reply starts as reasoning
    names: frozenset = frozenset()  # the declared functions (a loose bare call must name one)
    echo: bool = False  # remove echoed <tool_response> tags from the content
    repeated: bool = False  # a call repeated an earlier one: the calls (and the reply) ended there
    _buf: str = ""  # text not yet decided
    _state: str = "start"  # start | think | loose | content | body | after | over
    _seen_text: bool = False  # content other than whitespace was sent
    _body: str = ""  # the current call body
    _calls: list[_Call] = field(default_factory=list)  # every call announced so far
    _base: int = 0  # calls announced before the current body
    _opened: str = ""  # the marker that opened the current body ("": a bare start)
    _skip_space: bool = False  # drop the whitespace that follows a removed echo tag

    def __post_init__(self) -> None:
        if self.in_think:
            self._state = "think"

    @property
    def _markers(self) -> tuple[str, ...]:
        """What the content state looks for: the call marker, and the echoed tags."""
        return ((self.fmt.open,) if self.fmt is not None else ()) + (ECHO_TAGS if self.echo else ())

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
        if self._state == "loose" and not self._end_loose(out):
            self._state = "content"  # not one bare call: content
            while self._step(out, final=True):
                pass
        if self._state == "body":
            self._end_body(out, closed=False)
        elif self._buf and self._state == "think":
            out.append(Delta("reasoning", self._buf))
        self._buf = ""
        return [d for d in out if d.kind == "tool" or d.text]

    # -- the state machine: each step consumes part of _buf; False when it needs more text ----------
    def _step(self, out: list[Delta], final: bool) -> bool:
        state = self._state
        if state == "over":
            self._buf = ""
            return False
        if state == "start":
            return self._start(final)
        if state == "think":
            return self._reason(out, final)
        if state == "body":
            return self._read_body(out, final)
        if state == "loose":
            return self._loose(final)
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
        if self.fmt is not None and self.fmt.loose and self.names and stripped[:1] == "{":
            self._buf, self._state = stripped, "loose"
            return True
        if not stripped and not final:
            return False  # only whitespace so far: the body or <think> may follow
        self._buf, self._state = stripped, "content"  # the reply's content starts at its first visible character
        return True

    def _reason(self, out: list[Delta], final: bool) -> bool:
        at = self._buf.find(THINK_CLOSE)
        call = self._call_in_reasoning(at, final)
        if call is None:  # a marker that may open a call: wait for more
            return False
        if call >= 0:
            self._send(out, "reasoning", self._buf[:call])
            self._buf, self._state, self.think = self._buf[call:], "content", False
            return True
        if at < 0:
            keep = 0 if final else _held(self._buf, (THINK_CLOSE,) + ((self.fmt.open,) if self.fmt else ()))
            self._send(out, "reasoning", self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._send(out, "reasoning", self._buf[:at])
        self._buf, self._state = self._buf[at + len(THINK_CLOSE):].lstrip(), "start"
        self.think = False  # one reasoning block per reply
        return True

    def _call_in_reasoning(self, close: int, final: bool) -> int | None:
        """Where a call marker that opens a call object starts in the reasoning before ``close`` (-1: none
        there; None: a marker whose body cannot be told yet)."""
        if self.fmt is None:
            return -1
        start = 0
        while True:
            at = self._buf.find(self.fmt.open, start)
            if at < 0 or (0 <= close < at):
                return -1
            opens = opens_call(self.fmt, self._buf[at + len(self.fmt.open):])
            if opens:
                return at
            if opens is None and not final:
                return None
            start = at + 1

    def _loose(self, final: bool) -> bool:
        """A reply that began with ``{``: held while it may still be one bare call, else content."""
        text = self._buf
        opens = opens_call(self.fmt, text)  # type: ignore[arg-type]
        name = scan(self.fmt, text)  # type: ignore[arg-type]
        end = value_end(text, 0)
        if opens is False or (name and name[0].name not in self.names) or (end is not None and text[end:].strip()):
            self._state = "content"  # not a bare call: all of it is content
            return True
        return False  # held to the end of the output (finish reads it)

    def _end_loose(self, out: list[Delta]) -> bool:
        """The whole reply held in ``loose``: announce it when it is one call object of a declared function,
        ``{"name": ..., "arguments": {...}}`` and nothing else."""
        try:
            value = json.loads(self._buf)
        except (json.JSONDecodeError, RecursionError, ValueError):
            return False
        keys = {"name", self.fmt.args_key} if self.fmt else set()
        if not (isinstance(value, dict) and set(value) == keys and value["name"] in self.names
                and isinstance(value[self.fmt.args_key], dict)):  # type: ignore[union-attr]
            return False
        self._announce(out, [Partial(value["name"], json.dumps(value[self.fmt.args_key]), True)])  # type: ignore[union-attr]
        self._buf, self._state = "", "after"
        return True

    def _content(self, out: list[Delta], final: bool) -> bool:
        if self._skip_space:
            self._buf = self._buf.lstrip()
            self._skip_space = not self._buf
        markers = self._markers
        if not markers:
            self._send(out, "content", self._buf)
            self._buf = ""
            return False
        at, marker = _first(self._buf, markers)
        if at < 0:
            keep = _held(self._buf, markers)
            text = self._buf[: len(self._buf) - keep]
            if self._state == "after" and not text.strip() and not final:  # whitespace between calls: wait
                return False
            self._send(out, "content", text if self._state != "after" or text.strip() else "")
            self._buf = "" if final else self._buf[len(self._buf) - keep:]  # a marker begun at the end: dropped
            return False
        before = self._buf[:at]
        self._send(out, "content", before if self._state != "after" or before.strip() else "")
        rest = self._buf[at + len(marker):]
        if marker in ECHO_TAGS:  # an echoed wrapper: removed, with the whitespace after it
            self._buf, self._skip_space = rest, True
            return True
        self._buf, self._state, self._body = rest, "body", ""
        self._opened = self.fmt.open  # type: ignore[union-attr]
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
            self._announce(out, scan(self.fmt, self._body))  # type: ignore[arg-type]
            return False
        self._body += self._buf[:at]
        self._buf = self._buf[at + len(close):]
        self._end_body(out, closed=True)
        if self._state != "over":
            self._state = "after"
        return True

    def _announce(self, out: list[Delta], partials: list[Partial]) -> None:
        """Send what is new in the current body's calls: the first call of the reply as it grows, a later
        one once complete (dropped, with all that follows, when it repeats an earlier call)."""
        for k, p in enumerate(partials):
            if self.repeated:
                return
            index = self._base + k
            if index == len(self._calls):
                if p.name is None or (index > 0 and not p.done):
                    return
                if index > 0 and any(c.name == p.name and _same(c.arguments, p.arguments) for c in self._calls):
                    self.repeated, self._state, self._buf = True, "over", ""
                    return
                self._calls.append(_Call(new_call_id(), p.name))
                out.append(Delta("tool", "", index, self._calls[index].id, p.name))
            call = self._calls[index]
            if len(p.arguments) > call.sent:
                out.append(Delta("tool", p.arguments[call.sent:], index))
                call.sent, call.arguments = len(p.arguments), p.arguments

    def _end_body(self, out: list[Delta], closed: bool) -> None:
        """A body is complete (``closed``: by its close marker, else by the end of the output): read it
        once more as a whole (any key order). Not calls -> content, unless it is markup the output cut
        (a closing format's body left open, or a body that began like a call)."""
        partials = scan(self.fmt, self._body)  # type: ignore[arg-type]
        if not (partials and all(p.done for p in partials)) and len(self._calls) == self._base:
            partials = parse_whole(self.fmt, self._body) or partials  # type: ignore[arg-type]
        self._announce(out, partials)
        cut = not closed and (bool(self.fmt and self.fmt.close) or opens_call(self.fmt, self._body) is not False)  # type: ignore[arg-type]
        if len(self._calls) == self._base and not self.repeated and not cut:  # nothing was a call: the text is content
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


def complete(calls: list[dict[str, Any]]) -> bool:
    """Every call's arguments are a whole JSON object (none was cut by the end of the output)."""
    for c in calls:
        try:
            if not isinstance(json.loads(c["function"]["arguments"]), dict):
                return False
        except (json.JSONDecodeError, RecursionError, ValueError):
            return False
    return bool(calls)
