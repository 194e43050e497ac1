"""Tool-call formats: how each model family writes a call, how to read one back, and the grammar
that makes a constrained call valid.

    fmt = tool_format(template_text, override=None)     # FORMATS["hermes"], ... (chosen from the template)
    scan(fmt, body) -> [Partial(name, arguments_so_far, done), ...]   # also on a body still being written
    call_grammar(fmt, functions, choice, parallel) -> Lark text for llguidance

| format  | the model writes                                                   | families            |
|---------|--------------------------------------------------------------------|---------------------|
| hermes  | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one per call) | Qwen 2.5/3, Hermes, SmolLM3 |
| llama3  | `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or alone) | Llama 3.1-3.3       |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`              | Mistral, Mixtral    |
| phi4    | `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`    | Phi-4-mini          |

Special-token markers (`<|python_tag|>`, `[TOOL_CALLS]`, `<|tool_call|>` in those tokenizers) are not
in the decoded text (special tokens are skipped), so those formats also accept the JSON at the very
start of the output ("bare" start), and their constrained grammars write the JSON without the
marker. A hermes reply that is nothing but one call's JSON object, without its tags, is read as that
call when it names a declared function (``loose``: small models, SmolLM2 among them, often drop the
tags); runtime/chat/output.py applies that rule. Gemma has no tool-call format of its own in its
template; use ``tool_parser="hermes"``.

Constrained calls (``call_grammar``): a named function is one call; ``required`` is one call, and
another only where the model writes the next call's opening itself (whitespace after a call may also
end the output, so a newline never forces a second call).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from decodert.errors import DecodertError


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # the marker that opens the calls, as it appears in the text
    close: str  # the marker that closes them ("": the end of the output)
    array: bool  # the body is a JSON list of calls, not one call
    args_key: str  # "arguments" | "parameters"
    bare: str = ""  # a character that opens the body at the output's start without the marker ("": none)
    loose: bool = False  # a whole reply that is one call object without the markers is that call


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", False, "arguments", loose=True),
    "llama3": ToolFormat("llama3", "<|python_tag|>", "", False, "parameters", bare="{"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", True, "arguments", bare="["),
    "phi4": ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>", True, "arguments", bare="["),
}
ALIASES = {"qwen": "hermes", "qwen3": "hermes", "smollm3": "hermes", "llama": "llama3", "phi": "phi4"}
# what a template says about its format, checked in this order (the first found wins)
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"),
                   ("<|tool_call|>", "phi4"), ("<|python_tag|>", "llama3"), ("Environment: ipython", "llama3"))


def tool_format(template: str | None, override: str | None = None) -> ToolFormat:
    """The format named by ``override`` (``tool_parser=``), else the one the template writes, else hermes."""
    if override:
        name = ALIASES.get(override, override)
        if name not in FORMATS:
            raise DecodertError(f"unknown tool parser {override!r}; expected one of {', '.join(FORMATS)}")
        return FORMATS[name]
    for sign, name in _TEMPLATE_SIGNS:
        if template and sign in template:
            return FORMATS[name]
    return FORMATS["hermes"]


@dataclass
class Partial:
    """One call read from a body that may still be growing: ``arguments`` only ever grows."""

    name: str | None
    arguments: str  # the raw JSON text of the arguments so far
    done: bool  # the call's object is closed


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_CLOSE = re.compile(r"\s*\}")
_NEXT = re.compile(r"\s*[,;]")


def value_end(text: str, start: int) -> int | None:
    """Index just after the JSON value starting at ``start``; None while it is not complete."""
    depth, in_string, escape = 0, False, False
    if text[start] not in "{[\"":  # a scalar: ends at a delimiter
        m = re.compile(r"[^,}\]\s]*").match(text, start)
        return m.end() if m.end() < len(text) else None
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escape, in_string = (False, True) if escape else (c == "\\", c != '"')
            if not in_string and depth == -1:  # the end of a string value
                return i + 1
            continue
        if c == '"':
            in_string = True
            if depth == 0:  # a string value
                depth = -1
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan(fmt: ToolFormat, body: str) -> list[Partial]:
    """The calls in ``body`` (the text after the open marker) as far as they are written. Objects must
    put "name" before the arguments (every constrained call does); others are read by ``parse_whole``."""
    pos, out = 0, []
    if fmt.array:
        m = re.compile(r"\s*\[").match(body)
        if not m:
            return out
        pos = m.end()
    while True:
        m = _NAME.match(body, pos)
        if not m:
            return out
        name = _unquote(m.group(1))
        a = _ARGS.match(body, m.end())
        if not a:
            done = _CLOSE.match(body, m.end())
            out.append(Partial(name, "{}" if done else "", bool(done)))
            if not done:
                return out
            pos = done.end()
        else:
            end = value_end(body, a.end())
            out.append(Partial(name, body[a.end(): end], False))
            close = _CLOSE.match(body, end) if end is not None else None
            if close is None:
                return out
            out[-1].done, pos = True, close.end()
        nxt = _NEXT.match(body, pos)
        if not nxt:
            return out
        pos = nxt.end()


def opens_call(fmt: ToolFormat, text: str) -> bool | None:
    """Whether ``text`` (a body, from its start) begins a call object (``{"name"``, in a list for array
    formats): True, False, or None while too little is written to tell."""
    head = '[{"name"' if fmt.array else '{"name"'
    compact = re.sub(r"\s+", "", text[:64])
    if compact.startswith(head):
        return True
    return None if head.startswith(compact) else False


def parse_whole(fmt: ToolFormat, body: str) -> list[Partial] | None:
    """A complete body read as JSON (any key order) -> calls, or None when it is not calls."""
    text = body.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
        if not fmt.array and ";" in text:  # llama3 may separate calls with ';'
            try:
                value = [json.loads(p) for p in text.split(";") if p.strip()]
            except json.JSONDecodeError:
                return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(Partial(item["name"], args if isinstance(args, str) else json.dumps(args), True))
    return calls or None


def _unquote(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except json.JSONDecodeError:
        return s


# -- grammars: constrained calls through llguidance's Lark (runtime/constraints.py) ----------------
def call_schema(fmt: ToolFormat, functions: Sequence[dict]) -> dict:
    """A JSON schema for one call of any of ``functions`` ({"name", "parameters"}), "name" first.

    Parameters that refer into themselves (``"$ref": "#"``, pydantic's ``"#/$defs/Loc"``) are moved to the
    call schema's ``$defs`` under their function's name, with each such reference re-rooted there, so they
    resolve to the parameters schema, not to the call wrapper."""
    options, defs = [], {}
    for f in functions:
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if _refers_home(params):
            defs[f["name"]] = _rerooted(params, f"#/$defs/{f['name']}")
            params = {"$ref": f"#/$defs/{f['name']}"}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, fmt.args_key: params},
                        "required": ["name", fmt.args_key], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _refers_home(node: Any) -> bool:
    """Whether a schema holds a ``$ref`` into its own document (``#...``)."""
    if isinstance(node, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or _refers_home(v) for k, v in node.items())
    return isinstance(node, list) and any(_refers_home(v) for v in node)


def _rerooted(node: Any, root: str) -> Any:
    """``node`` with every ``"$ref": "#..."`` pointing under ``root`` instead of the document's root."""
    if isinstance(node, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rerooted(v, root))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rerooted(v, root) for v in node]
    return node


def _lit(text: str) -> str:
    return json.dumps(text)


def call_grammar(fmt: ToolFormat, functions: Sequence[dict], required: bool, parallel: bool) -> str:
    """Lark text: ``required``: only calls; else free text, or text then calls (hermes), or text or calls
    (bare formats: calls only at the start). Each call's JSON validates against its function's schema.
    ``parallel``: more calls may follow the first, each opened by the model (never forced by a separator)."""
    one = "call: %json " + json.dumps(call_schema(fmt, functions))
    if fmt.array:
        calls = '"[" call (", " call)* "]"' if parallel else '"[" call "]"'
    else:
        calls = 'call ("\\n" call)*' if parallel else "call"
    if fmt.close and not fmt.array:  # hermes: every call is wrapped
        wrapped = f"{_lit(fmt.open)} call {_lit(fmt.close)}"
        calls = f'{wrapped} ("\\n"? {wrapped})* "\\n"?' if parallel else wrapped
    elif fmt.close:
        calls = f"{calls} {_lit(fmt.close)}"
    if required:
        return f"start: {calls}\n{one}\n"
    if fmt.bare:  # free text that does not start like the body, or the body
        text = "TEXT: /(.|\\n)*/ & ~/\\s*" + re.escape(fmt.bare) + "(.|\\n)*/"
        return f"start: TEXT | {calls}\n{text}\n{one}\n"
    marker = re.escape(fmt.open)
    rest = calls[len(_lit(fmt.open)):] if calls.startswith(_lit(fmt.open)) else calls
    return (f"start: TEXT | PRE {rest}\n"
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"
            f"PRE: /(.|\\n)*{marker}/ & ~/(.|\\n)*{marker}(.|\\n)+/\n{one}\n")
