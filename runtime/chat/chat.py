"""Chat templates: render a model's Jinja chat template over messages, sandboxed.

Templates come from model files, so they run in an immutable sandbox where any unsafe
attribute access (``__class__``, ``__globals__`` ...) raises instead of rendering as empty, with
limits on time, output size and value sizes (runtime/chat/template_sandbox.py: 2 s, 4 Mi characters,
range/integer arguments 100,000); rendering is safe from any thread (per-thread deadlines).
The helpers match what Hugging Face templates expect: ``raise_exception``, ``strftime_now``
and a ``tojson`` filter that keeps non-ASCII text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import SecurityError

from decodert.errors import DecodertError
from decodert.runtime import validate
from decodert.runtime.chat.tools import check_tool_messages
from decodert.runtime.chat.template_sandbox import DEFAULT_LIMITS, LimitedSandbox, Limits, TemplateLimit, render_limited

Message = Mapping[str, Any]


class _TemplateRaised(Exception):
    """``raise_exception(msg)`` called by the template itself."""


class _StrictSandbox(LimitedSandbox):
    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (DecodertError on a syntax error)."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DecodertError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None
    except (RecursionError, MemoryError, ValueError, TypeError) as e:  # absurd nesting or size in the source
        raise DecodertError(f"chat template cannot be compiled ({type(e).__name__})") from None


def check_messages(messages: Sequence[Message]) -> list[dict]:
    """Validate ``[{"role": str, "content": str}, ...]`` and return plain dict copies."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise DecodertError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or ("content" not in m and "tool_calls" not in m):
            raise DecodertError(f"chat message {i} must be a dict with a string 'role' and a 'content'")
        out.append(dict(m))
    check_tool_messages(out)  # assistant tool_calls, role "tool" (runtime/chat/tools.py)
    return out


def render_chat(template: str | None, messages: Sequence[Message], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, limits: Limits = DEFAULT_LIMITS, **extra: Any) -> str:
    """Render ``messages`` with the model's chat template (sandboxed, within ``limits``) -> prompt text."""
    if not template:
        raise DecodertError("this model has no chat template (manifest.json tokenizer.chat_template); "
                            "use a plain prompt instead of --chat")
    compiled = compile_template(template)
    messages = check_messages(messages)
    try:
        text = render_limited(compiled, limits, messages=messages, bos_token=bos_token,
                              eos_token=eos_token, add_generation_prompt=add_generation_prompt, **extra)
    except TemplateLimit as e:
        raise DecodertError(f"chat template stopped: {e} (limits for templates from model files)") from None
    except _TemplateRaised as e:
        raise DecodertError(f"chat template rejected the messages: {e}") from None
    except MemoryError:
        raise DecodertError("chat template stopped: it ran out of memory") from None
    except SecurityError as e:
        raise DecodertError(f"chat template tried an unsafe operation: {e}") from None
    except Exception as e:  # template errors of any kind (TemplateError, TypeError, ...): one line
        raise DecodertError(f"chat template failed to render: {type(e).__name__}: {str(e)[:200]}") from None
    return validate.check_text(text, "the rendered chat prompt")


def _own_parameters(*functions: Any) -> frozenset[str]:
    import inspect

    return frozenset(name for f in functions for name, p in inspect.signature(f).parameters.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


# what extra template variables (chat_template_kwargs) cannot be named: the render calls' own parameters
RENDER_PARAMETERS = _own_parameters(render_chat, render_limited)
