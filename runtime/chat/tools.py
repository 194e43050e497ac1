"""Tools in a chat request: checked, rendered into the prompt, and turned into a constraint.

    spec = check_tools(tools, tool_choice, parallel_tool_calls)   # None: no tools (or tool_choice "none")
    check_tool_messages(messages)                                   # role "tool" / assistant "tool_calls"
    spec.constraint(fmt) -> Constraint | None                       # runtime/constraints.py (Lark + %json)

tool_choice: "auto" (the model answers text or calls; a call, once opened, is constrained to a valid
call), "required" (only calls), {"type": "function", "function": {"name": ...}} (a call of that one
function), "none" (the tools are not rendered and no call is read). Function ``parameters`` are
made strict (``additionalProperties: false`` where a schema leaves it open), so every constrained
call's arguments validate against the schema the client gave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from decodert.errors import DecodertError
from decodert.runtime import validate
from decodert.runtime.chat.tool_calls import ToolFormat, call_grammar

CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple  # OpenAI tool dicts, as given: {"type": "function", "function": {...}}
    functions: tuple  # {"name", "parameters" (strict)} per tool
    choice: str  # "auto" | "required" | a function's name
    parallel: bool

    def constraint(self, fmt: ToolFormat) -> Any:
        from decodert.runtime.constraints import Constraint

        chosen = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        return Constraint("grammar", call_grammar(fmt, chosen, self.choice != "auto", self.parallel))

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
    HF templates expect them); DecodertError naming the message on a malformed one."""
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise _err(f"chat message {i} (role 'tool') needs a string 'tool_call_id'")
            if not isinstance(m.get("content"), str):
                raise _err(f"chat message {i} (role 'tool') needs a string 'content'")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m.get("role") != "assistant" or not isinstance(calls, (list, tuple)):
            raise _err(f"chat message {i}: 'tool_calls' must be a list, on an assistant message")
        m["tool_calls"] = [_tool_call(i, k, c) for k, c in enumerate(calls)]
        if m.get("content") is None:
            m["content"] = ""


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


def flatten_tool_messages(messages: list[dict]) -> list[dict]:
    """For a template without tool support: assistant calls and tool results as plain text turns."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]}) + "</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        else:
            out.append(m)
    return out
