"""One chat turn's options: tools, reasoning and template arguments, from rendering to the split reply.

    turn = chat_turn(template, messages, options, tool_parser)   # options: the CHAT_ARGS given to llm.chat
    text = render(..., turn.messages, **turn.template_kwargs)     # the caller renders (runtime/llm.py)
    result = turn.finish(result, prompt_text)                     # text -> content, reasoning, tool_calls
    stream = ChatStream(text_stream, turn.output(prompt_text))    # content deltas; .deltas has all of them

A template that renders ``tools`` itself gets them as the jinja variable ``tools`` (as Hugging Face
templates take them); for one that does not (SmolLM2's), the tools are described in the system
message in the chosen format (runtime/chat/tools.py ``system_prompt``). Earlier calls reach a template
that reads ``tool_calls`` as they are, and are written into the assistant's text (in the chosen format)
for one that does not. Tool results reach the template as ``role: "tool"`` messages wherever it
renders one (a probe render shows their content: Qwen's wraps them in ``<tool_response>`` itself,
SmolLM2's writes a ``tool`` turn); only a template that refuses or drops them gets them as user
messages holding ``<tool_response>...</tool_response>``.

The reply's finish reason is "tool_calls" whenever it returns calls whose arguments are complete JSON
(``call_finish``): a reply the model ended, one a repeated call ended (``watcher``), and one the token
budget closed (runtime/closing.py) alike; "length" stays where the budget cut a call's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Mapping

from decodert.errors import DecodertError
from decodert.runtime.chat.chat import RENDER_PARAMETERS, check_messages, render_chat
from decodert.runtime.chat.harmony import HarmonyOutput, speaks_harmony
from decodert.runtime.chat.output import ChatOutput, Delta, THINK_CLOSE, THINK_OPEN, assemble, complete
from decodert.runtime.chat.tool_calls import ToolFormat, tool_format
from decodert.runtime.chat.tools import ToolSpec, check_tools, flatten_tool_messages, with_tools

CHAT_ARGS = ("tools", "tool_choice", "parallel_tool_calls", "enable_thinking", "chat_template_kwargs")


@dataclass
class ChatTurn:
    messages: list[dict]  # what the template renders
    template_kwargs: dict = field(default_factory=dict)  # tools=, enable_thinking=, chat_template_kwargs
    tools: ToolSpec | None = None
    fmt: ToolFormat | None = None  # the tool-call format read from the reply (None: no tools)
    think: bool = False  # the template thinks in <think>...</think>
    harmony: bool = False  # the template speaks harmony (gpt-oss): analysis channel = reasoning, final = content
    results: bool = False  # the conversation holds tool results (an echoed <tool_response> wrapper is removed)

    @property
    def plain(self) -> bool:
        """Nothing to split: the reply is all content (as before tools and reasoning existed)."""
        return self.tools is None and not self.think and not self.harmony and not self.results

    def constraint(self, other: Any) -> Any:
        """The tools' constraint, or ``other`` (json_schema / regex / grammar); both at once is an error."""
        if self.tools is None or self.harmony:  # harmony calls are read, not constrained (chat_turn refuses
            return other  # a tool_choice that would need the constraint)
        if other is not None:
            raise DecodertError("give either tools or a structured-output constraint (json_schema, regex, "
                                "grammar, response_format), not both")
        return self.tools.constraint(self.fmt)

    def output(self, prompt: str) -> Any:
        """A fresh splitter for this turn's reply; ``prompt``: the rendered prompt (it may open <think>)."""
        if self.harmony:
            return HarmonyOutput(tools=self.tools is not None)
        tail = prompt.rstrip()
        in_think = self.think and tail.endswith(THINK_OPEN)
        names = self.tools.names if self.tools is not None else frozenset()
        return ChatOutput(self.fmt, think=self.think, in_think=in_think, names=names, echo=self.results)

    def watcher(self, prompt: str) -> Callable[[str], bool] | None:
        """For the engine (``Sequence.watch``): fed the reply's text as it is made, True once a tool call
        repeats an earlier one, which ends the reply (None: no tools, nothing to watch)."""
        if self.tools is None or self.harmony:
            return None
        out, pending = self.output(prompt), [""]

        def watch(text: str) -> bool:  # a call can only be complete at a "}", "]" or ">": the text is read there
            pending[0] += text
            if any(c in text for c in "}]>"):
                out.feed(pending[0])
                pending[0] = ""
            return out.repeated

        return watch

    def finish(self, result: Any, prompt: str) -> Any:
        """The GenerationResult with its text split into content, ``reasoning`` and ``tool_calls``."""
        if self.plain:
            return result
        out = self.output(prompt)
        return split_result(result, out.feed(result.text) + out.finish(), self.tools is not None)


def split_result(result: Any, deltas: list[Delta], tools: bool) -> Any:
    content, reasoning, calls = assemble(deltas)
    return replace(result, text=content or "", reasoning=reasoning, tool_calls=calls if tools else None,
                   finish_reason=call_finish(result.finish_reason, calls))


def call_finish(reason: str, calls: list[dict]) -> str:
    """The finish reason of a reply that returns ``calls``: "tool_calls" when they are all complete and the
    reply ended ("stop") or was closed to fit its budget ("length"); else ``reason``."""
    return "tool_calls" if reason in ("stop", "length") and complete(calls) else reason


def pop_options(params: dict) -> dict:
    """Take the chat-only arguments out of generation keyword arguments."""
    return {k: params.pop(k) for k in CHAT_ARGS if k in params}


def chat_turn(template: str | None, messages: Any, options: Mapping[str, Any], tool_parser: str | None = None) -> ChatTurn:
    """Validate the messages and options (DecodertError, one line) -> the turn to render."""
    msgs = check_messages(messages)
    spec = check_tools(options.get("tools"), options.get("tool_choice"), options.get("parallel_tool_calls"))
    kwargs = dict(_template_kwargs(options))
    harmony = speaks_harmony(template)
    think = bool(template) and THINK_CLOSE in (template or "") and not harmony
    results = any(m.get("role") == "tool" for m in msgs) and not harmony
    history = results or any(m.get("tool_calls") for m in msgs)
    fmt = tool_format(template, tool_parser) if spec is not None or history else None
    if fmt is not None and not harmony:  # calls into the text where the template does not read them; results as it takes them
        msgs = flatten_tool_messages(msgs, fmt, calls="tool_calls" not in (template or ""),
                                     results=not renders_tool_role(template))
    if spec is None:
        return ChatTurn(msgs, kwargs, None, None, think, harmony, results)
    if harmony and spec.choice != "auto":
        raise DecodertError(f"tool_choice {spec.choice!r} is not supported for a harmony (gpt-oss) template: its calls "
                            "are read from the reply, not constrained; use tool_choice 'auto'")
    if template and "tools" in template:
        kwargs["tools"] = spec.template_tools()
    else:
        msgs = with_tools(msgs, spec, fmt)  # type: ignore[arg-type]
    return ChatTurn(msgs, kwargs, spec, fmt, think, harmony, results)


_PROBE = "decodert-tool-result-probe"


@lru_cache(maxsize=16)
def renders_tool_role(template: str | None) -> bool:
    """Whether ``template`` renders a ``role: "tool"`` message's content (a probe render; False when it
    raises, or drops the message)."""
    if not template:
        return False
    probe = [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "call_0", "content": _PROBE}]
    try:
        return _PROBE in render_chat(template, probe)
    except DecodertError:
        return False


def _template_kwargs(options: Mapping[str, Any]) -> dict:
    extra = options.get("chat_template_kwargs")
    if extra is not None and (not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra)):
        raise DecodertError("chat_template_kwargs must be a dict with string keys")
    out = dict(extra or {})
    for reserved in sorted(out.keys() & (RENDER_PARAMETERS | {"tools"})):  # a collision was a TypeError, a 500
        raise DecodertError(f"chat_template_kwargs cannot set {reserved!r} (it has its own argument)")
    thinking = options.get("enable_thinking")
    if thinking is not None:
        if not isinstance(thinking, bool):
            raise DecodertError(f"enable_thinking must be true or false, got {thinking!r:.40}")
        out["enable_thinking"] = thinking
    return out


class ChatStream:
    """``llm.stream_chat`` with tools or reasoning: iterates the content deltas (str); ``deltas`` holds
    every Delta (reasoning, tool calls) so far, ``result`` the split GenerationResult at the end."""

    def __init__(self, stream: Any, output: ChatOutput, tools: bool) -> None:
        self._stream, self._out, self._tools = stream, output, tools
        self.deltas: list[Delta] = []
        self._pending: list[str] = []
        self._ended = False
        self.result: Any = None

    def __iter__(self) -> "ChatStream":
        return self

    def __next__(self) -> str:
        while not self._pending:
            if self._ended:
                raise StopIteration
            try:
                self._take(self._out.feed(next(self._stream)))
            except StopIteration:
                self._ended = True
                self._take(self._out.finish())
                if self._stream.result is not None:
                    self.result = split_result(self._stream.result, self.deltas, self._tools)
        return self._pending.pop(0)

    def _take(self, deltas: list[Delta]) -> None:
        self.deltas += deltas
        self._pending += [d.text for d in deltas if d.kind == "content" and d.text]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas if d.kind == "content")

    def close(self) -> None:
        self._stream.close()
