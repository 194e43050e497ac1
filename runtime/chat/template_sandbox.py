"""A jinja2 sandbox with limits for chat templates: time, output size, sizes of values and ranges.

A chat template comes from a model file, i.e. from a stranger, and is code. jinja2's
``ImmutableSandboxedEnvironment`` blocks unsafe attributes but not a loop of 10^10 iterations,
``lipsum(10**8)`` or ``'a' * 4e9``. ``LimitedSandbox`` adds:

- a deadline: the compiled template calls ``decodert_tick()`` at the top of every block (each loop
  iteration, if branch and macro call), and every call, filter, operator and output chunk checks
  it too; past it rendering stops with ``TemplateLimit``;
- sizes: a string or list made by a call, a filter, ``+``, ``*`` or ``~`` may hold at most
  ``max_output`` items (checked before ``*`` and ``+`` build it); integer arguments of calls and
  filters and ``range`` lengths are at most ``max_range``; ``**`` results at most 4096 bits;
  format strings (``%``, ``|format``, ``str.format``) may not carry 6-digit widths;
- the rendered text stops at ``max_output`` characters.

Limits live in a per-thread slot set by ``limits(...)``, so one compiled template may render in
many threads at once (a server's requests) and each render has its own deadline.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from jinja2 import compiler, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateLimit(Exception):
    """A render went past one of its limits (the message says which)."""


@dataclass(frozen=True)
class Limits:
    seconds: float = 2.0  # wall time of one render
    max_output: int = 1 << 22  # characters of output, and items of any string/list built (4 Mi)
    max_range: int = 100_000  # range() length and any integer argument of a call or filter


DEFAULT_LIMITS = Limits()
_WIDTH = re.compile(r"\d{6,}")  # a format width/precision of 100000 or more
_state = threading.local()


def _deadline() -> float:
    return getattr(_state, "deadline", float("inf"))


def _limits() -> Limits:
    return getattr(_state, "limits", DEFAULT_LIMITS)


@contextlib.contextmanager
def limits(lim: Limits = DEFAULT_LIMITS) -> Iterator[None]:
    """Run the renders inside under ``lim`` (this thread only)."""
    saved = getattr(_state, "limits", None), getattr(_state, "deadline", None)
    _state.limits, _state.deadline = lim, time.monotonic() + lim.seconds
    try:
        yield
    finally:
        _state.limits, _state.deadline = saved


def tick() -> None:
    if time.monotonic() > _deadline():
        raise TemplateLimit(f"rendering took more than {_limits().seconds:g} s")


def _weight(value: Any, limit: int) -> int:
    """Items in ``value`` counted through nested lists/tuples/dicts (strings by length); stops
    counting once past ``limit`` (so the walk itself is bounded)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, dict):
            total += 1
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 1
            stack.extend(v)
        else:
            total += 1
    return total


def _sized(value: Any) -> Any:
    """``value`` unless it holds more than max_output items (nested containers and strings counted)."""
    limit = _limits().max_output
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) and _weight(value, limit) > limit:
        raise TemplateLimit(f"a value larger than {limit:,} items")
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    bound = _limits().max_range
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > bound:
            raise TemplateLimit(f"an integer argument {a} is larger than {bound:,}")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDTH.search(fmt):
        raise TemplateLimit("a format string with a width or precision of 100000 or more")


def _mul(left: Any, right: Any) -> Any:
    limit = _limits().max_output
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 0:
            if _weight(seq, limit) * n > limit:
                raise TemplateLimit(f"repeating a value {n:,} times makes more than {limit:,} items")
    return left * right


def _add(left: Any, right: Any) -> Any:
    limit = _limits().max_output
    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        if _weight(left, limit) + _weight(right, limit) > limit:
            raise TemplateLimit(f"joining two values makes more than {limit:,} items")
    return left + right


def _pow(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if abs(left).bit_length() * right > 4096:
            raise TemplateLimit(f"{left} ** {right} is larger than 4096 bits")
    return left ** right


def _mod(left: Any, right: Any) -> Any:
    _check_format(left)
    return _sized(left % right)


class _TickingCodeGenerator(compiler.CodeGenerator):
    """Compiles a deadline check into every block and a size check around every ``~``."""

    def blockvisit(self, nodes_: Any, frame: compiler.Frame) -> None:
        self.writeline("environment.decodert_tick()")
        super().blockvisit(nodes_, frame)

    def visit_Concat(self, node: nodes.Concat, frame: compiler.Frame) -> None:
        self.write("environment.decodert_sized(")
        super().visit_Concat(node, frame)
        self.write(")")


def _limited_filter(f: Callable) -> Callable:
    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment markers
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tick()
        _check_args(args, kwargs)
        if f.__name__ in ("do_format", "format"):
            _check_format(args[0] if args else None)
        return _sized(f(*args, **kwargs))

    return wrapper


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with the limits of ``limits()`` (see the module docstring)."""

    code_generator_class = _TickingCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.binop_table = {**self.binop_table, "*": _mul, "**": _pow, "+": _add, "%": _mod}
        self.filters = {name: _limited_filter(f) for name, f in self.filters.items()}
        self.globals["range"] = self._range
        self.globals.pop("lipsum", None)  # lipsum(n) is one call of unbounded time; no chat template uses it
        self.decodert_tick = tick
        self.decodert_sized = _sized

    def add_filter(self, name: str, f: Callable) -> None:
        self.filters[name] = _limited_filter(f)

    @staticmethod
    def _range(*args: int) -> range:
        _check_args(args, {})
        r = range(*args)
        if len(r) > _limits().max_range:
            raise TemplateLimit(f"range of {len(r):,} items is longer than {_limits().max_range:,}")
        return r

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tick()
        _check_args(args, kwargs)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        tick()
        return super().call_binop(context, operator_, left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped


def render_limited(template: Any, lim: Limits = DEFAULT_LIMITS, **variables: Any) -> str:
    """Render ``template`` (compiled by a LimitedSandbox) under ``lim``; TemplateLimit past a limit."""
    with limits(lim):
        out: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > lim.max_output:
                raise TemplateLimit(f"the output is longer than {lim.max_output:,} characters")
            out.append(chunk)
            tick()
        return "".join(out)
