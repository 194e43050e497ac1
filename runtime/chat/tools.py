"""Tools in a chat request: checked, rendered into the prompt, and turned into a constraint.

    spec = check_tools(tools, tool_choice, parallel_tool_calls)   # None: no tools (or tool_choice "none")
    check_tool_messages(messages)                                   # role "tool" / assistant "tool_calls"
    spec.constraint(fmt) -> Constraint | None                       # runtime/constraints.py (Lark + %json)

tool_choice: "auto" (the model answers text or calls; a call, once opened, is constrained to a valid
call), "required" (calls only: one, and more only where the model opens another while
``parallel_tool_calls`` is on), {"type": "function", "function": {"name": ...}} (exactly one call of
that function, whatever ``parallel_tool_calls`` says, as OpenAI and vLLM answer), "none" (the tools
are not rendered and no call is read). Function ``parameters`` are made strict
(``additionalProperties: false`` where a schema leaves it open), so every constrained call's arguments
validate against the schema the client gave. Function names follow OpenAI's pattern
(``NAME_PATTERN``), and tools must be plain JSON (no sets, bytes, ...): anything else is a one-line
DecodertError before the template sees them.

Tool messages (``check_tool_messages``): an assistant message's ``tool_calls`` each need an ``id``,
and the messages right after it must be ``role: "tool"`` messages answering each id once (OpenAI's
400s, for a call left unanswered and for an id no call has).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from decodert.errors import DecodertError
from decodert.runtime import validate
from decodert.runtime.chat.tool_calls import ToolFormat, call_grammar

CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple  # OpenAI tool dicts, as given: {"type": "function", "function": {...}}
    functions: tuple  # {"name", "parameters" (strict)} per tool
    choice: str  # "auto" | "required" | a function's name
    parallel: bool

    def constraint(self, fmt: ToolFormat) -> Any:
        from decodert.runtime.constraints import Constraint

        chosen = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        return Constraint("grammar", call_grammar(fmt, chosen, self.choice != "auto", self.parallel and not self.named))

    @property
    def named(self) -> bool:
        """tool_choice names one function: exactly one call of it."""
        return self.choice not in CHOICES

    @property
    def names(self) -> frozenset:
        """The declared function names (a bare JSON call must name one: runtime/chat/output.py)."""
        return frozenset(f["name"] for f in self.functions)

    def template_tools(self) -> list[dict]:
        """The tools as HF chat templates take them (``tools`` variable): the OpenAI dicts."""
        return [dict(t) for t in self.tools]


def _err(message: str) -> DecodertError:
    return DecodertError(message)


def _function(i: int, tool: Any) -> dict:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise _err(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}")
    fn = tool.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _err(f"tools[{i}].function needs a non-empty string 'name'")
    if not NAME_PATTERN.fullmatch(fn["name"]):
        raise _err(f"tools[{i}].function.name must match ^[a-zA-Z0-9_-]{{1,64}}$ (letters, digits, '_' and '-'), "
                   f"got {fn['name']!r:.80}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise _err(f"tools[{i}].function.parameters must be a JSON schema object")
    from decodert.runtime.constraints import strict_schema

    return {"name": fn["name"], "parameters": strict_schema(params)}


def check_tools(tools: Any, tool_choice: Any = None, parallel: Any = None) -> ToolSpec | None:
    """Validate OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None when no tool is in play."""
    if parallel is not None and not isinstance(parallel, bool):
        raise _err(f"parallel_tool_calls must be true or false, got {parallel!r:.40}")
    if tools is None or (isinstance(tools, (list, tuple)) and not tools):
        if tool_choice not in (None, "none", "auto"):
            raise _err("tool_choice needs tools")
        return None
    if not isinstance(tools, (list, tuple)) or len(tools) > MAX_TOOLS:
        raise _err(f"tools must be a list of at most {MAX_TOOLS} function tools")
    for i, tool in enumerate(tools):
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as e:  # a set, bytes, any object JSON cannot write
            raise _err(f"tools[{i}] must be plain JSON (dicts, lists, strings, numbers, booleans, null): {e}") from None
        except RecursionError:
            raise _err(f"tools[{i}] is nested too deeply") from None
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _err(f"tools: function names must be unique, got {names}")
    choice = _choice(tool_choice, names)
    if choice == "none":
        return None
    return ToolSpec(tuple(tools), functions, choice, True if parallel is None else parallel)


def _choice(tool_choice: Any, names: Sequence[str]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise _err(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {tool_choice!r:.40}")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise _err("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise _err(f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})")
    return name


def check_tool_messages(messages: list[dict]) -> None:
    """Assistant ``tool_calls`` and ``role: "tool"`` messages (in place: string arguments -> dicts, as
    HF templates expect them); DecodertError naming the message on a malformed one. The tool messages
    right after an assistant message with ``tool_calls`` must answer each of its ids once (OpenAI's
    rule); after an assistant message whose calls are in its text (a Session keeps the reply as the
    model wrote it) the ids are not checked."""
    pending: dict[str, int] | None = None  # call id -> the assistant message that made it; None: not checked
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise _err(f"chat message {i} (role 'tool') needs a string 'tool_call_id'")
            if not isinstance(m.get("content"), str):
                raise _err(f"chat message {i} (role 'tool') needs a string 'content'")
            if pending is not None and pending.pop(m["tool_call_id"], None) is None:
                raise _err(f"chat message {i}: messages with role 'tool' must be a response to a preceding message "
                           f"with 'tool_calls'; no pending call has id {m['tool_call_id']!r:.80}")
            continue
        _unanswered(pending)
        pending = None
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m.get("role") != "assistant" or not isinstance(calls, (list, tuple)):
            raise _err(f"chat message {i}: 'tool_calls' must be a list, on an assistant message")
        m["tool_calls"] = [_tool_call(i, k, c) for k, c in enumerate(calls)]
        pending = {c["id"]: i for c in m["tool_calls"]}
        if len(pending) != len(m["tool_calls"]):
            raise _err(f"chat message {i}: tool_calls ids must be unique")
        if m.get("content") is None:
            m["content"] = ""
    _unanswered(pending)


def _unanswered(pending: dict[str, int] | None) -> None:
    if pending:
        ids = ", ".join(pending)
        raise _err(f"chat message {next(iter(pending.values()))}: an assistant message with 'tool_calls' must be "
                   "followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did "
                   f"not have response messages: {ids:.200}")


def _tool_call(i: int, k: int, call: Any) -> dict:
    where = f"chat message {i}: tool_calls[{k}]"
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise _err(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = validate.load_json(args, f"{where}.function.arguments") if args.strip() else {}
        except DecodertError as e:
            raise _err(str(e)) from None
    if not isinstance(args, Mapping):
        raise _err(f"{where}.function.arguments must be a JSON object")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise _err(f"{where} needs a string 'id' (the tool message answering it names it as 'tool_call_id')")
    return {**call, "type": "function", "function": {"name": fn["name"], "arguments": dict(args)}}


def system_prompt(spec: ToolSpec, fmt: ToolFormat) -> str:
    """Tool instructions for a template that does not render ``tools`` itself (e.g. SmolLM2's)."""
    listing = "\n".join(json.dumps(t.get("function", t)) for t in spec.tools)
    example = json.dumps({"name": "<function-name>", fmt.args_key: {"<arg>": "<value>"}})
    how = f"{fmt.open}{example}{fmt.close}" if not fmt.bare else (f"[{example}]" if fmt.array else example)
    return f"Functions you may call:\n{listing}\nTo call one, answer: {how}"


def with_tools(messages: list[dict], spec: ToolSpec, fmt: ToolFormat) -> list[dict]:
    """``messages`` with the tool instructions added to (or as) the system message."""
    text = system_prompt(spec, fmt)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def flatten_tool_messages(messages: list[dict], fmt: ToolFormat, calls: bool = True, results: bool = True) -> list[dict]:
    """For a template without tool support: ``calls``: assistant calls written into the assistant's text in
    ``fmt`` (the way the model writes them); ``results``: tool results as user turns in ``<tool_response>``."""
    out = []
    for m in messages:
        if results and m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif calls and m.get("tool_calls"):
            text = [{"name": c["function"]["name"], fmt.args_key: c["function"]["arguments"]} for c in m["tool_calls"]]
            body = json.dumps(text) if fmt.array else "\n".join(f"{fmt.open}{json.dumps(t)}{fmt.close}" for t in text)
            if fmt.array:
                body = f"{fmt.open}{body}{fmt.close}"
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "content": (m.get("content") or "") + body})
        else:
            out.append(m)
    return out
