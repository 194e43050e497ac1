"""One chat turn's options: tools, reasoning and template arguments, from rendering to the split reply.

    turn = chat_turn(template, messages, options, tool_parser)   # options: the CHAT_ARGS given to llm.chat
    text = render(..., turn.messages, **turn.template_kwargs)     # the caller renders (runtime/llm.py)
    result = turn.finish(result, prompt_text)                     # text -> content, reasoning, tool_calls
    stream = ChatStream(text_stream, turn.output(prompt_text))    # content deltas; .deltas has all of them

A template that renders ``tools`` itself gets them as the jinja variable ``tools`` (as Hugging Face
templates take them); for one that does not (SmolLM2's), the tools are described in the system
message in the chosen format (runtime/chat/tools.py ``system_prompt``) and earlier calls and tool
results are rendered as text turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from decodert.errors import DecodertError
from decodert.runtime.chat.chat import RENDER_PARAMETERS, check_messages
from decodert.runtime.chat.harmony import HarmonyOutput, speaks_harmony
from decodert.runtime.chat.output import ChatOutput, Delta, THINK_CLOSE, THINK_OPEN, assemble
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

    @property
    def plain(self) -> bool:
        """Nothing to split: the reply is all content (as before tools and reasoning existed)."""
        return self.tools is None and not self.think and not self.harmony

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
        return ChatOutput(self.fmt, think=self.think, in_think=in_think)

    def finish(self, result: Any, prompt: str) -> Any:
        """The GenerationResult with its text split into content, ``reasoning`` and ``tool_calls``."""
        if self.plain:
            return result
        out = self.output(prompt)
        return split_result(result, out.feed(result.text) + out.finish(), self.tools is not None)


def split_result(result: Any, deltas: list[Delta], tools: bool) -> Any:
    content, reasoning, calls = assemble(deltas)
    reason = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
    return replace(result, text=content or "", reasoning=reasoning, tool_calls=calls if tools else None,
                   finish_reason=reason)


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
    if spec is None:
        if any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs) and "tool" not in (template or ""):
            msgs = flatten_tool_messages(msgs)
        return ChatTurn(msgs, kwargs, None, None, think, harmony)
    if harmony and spec.choice != "auto":
        raise DecodertError(f"tool_choice {spec.choice!r} is not supported for a harmony (gpt-oss) template: its calls "
                            "are read from the reply, not constrained; use tool_choice 'auto'")
    fmt = tool_format(template, tool_parser)
    if template and "tools" in template:
        kwargs["tools"] = spec.template_tools()
    else:
        msgs = with_tools(flatten_tool_messages(msgs), spec, fmt)
    return ChatTurn(msgs, kwargs, spec, fmt, think, harmony)


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
