"""Typed JSON records: frozen dataclasses read from and written to plain JSON by their type hints.

A record class lists its fields with types; ``read_record(cls, value, where)`` checks each value
against its type and builds the dataclass, ``to_json(record)`` turns it back into JSON values.

- A field without a default is required; ``X | None`` allows null; a default makes it optional.
- ``tuple[X, ...]`` is a JSON list, ``Mapping[str, X]`` a JSON object (read-only after reading),
  ``int`` refuses booleans and floats, ``float`` takes ints, ``Any`` is kept as read.
- Keys the class does not know are kept in ``extra`` and written back unchanged, so an older
  decodert that rewrites a newer file (``decodert build`` adding engines) loses nothing.
- A field declared with ``OMIT_NULL`` metadata is left out while it is None, so a record that gained it
  writes the JSON it wrote before (manifest.json's ``embedding``).

Errors are one line: ``{where}.{field} is missing`` / ``... must be a list``, with the JSON path.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Mapping, TypeVar

from decodert.errors import DecodertError

R = TypeVar("R", bound="Record")
OMIT_NULL = {"omit_null": True}  # dataclasses.field(default=None, metadata=OMIT_NULL)


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of every record; ``extra`` holds the keys of the JSON object no field names."""

    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, kw_only=True, repr=False, compare=False)

    def replace(self: R, **changes: Any) -> R:
        """A copy with ``changes`` (the records are frozen)."""
        return dataclasses.replace(self, **changes)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def read_record(cls: type[R], value: Any, where: str) -> R:
    """A JSON object -> ``cls``; DecodertError names the first field that is missing or of the wrong type."""
    if not isinstance(value, dict):
        raise DecodertError(f"{where} must be an object")
    hints, known, kwargs = _hints(cls), set(), {}
    for f in dataclasses.fields(cls):
        if f.name == "extra":
            continue
        known.add(f.name)
        if f.name in value:
            kwargs[f.name] = read_value(hints[f.name], value[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise DecodertError(f"{where}.{f.name} is missing")
    extra = {k: v for k, v in value.items() if k not in known}
    return cls(**kwargs, extra=types.MappingProxyType(extra))


def read_value(tp: Any, value: Any, where: str) -> Any:
    """One JSON value checked against the type ``tp`` (see the module docstring)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own error names the field inside it
            return read_value(options[0], value, where)
        for option in options:
            try:
                return read_value(option, value, where)
            except DecodertError:
                continue
        raise DecodertError(f"{where} must be {' or '.join(_name(a) for a in args)}")
    if isinstance(tp, type) and issubclass(tp, Record):
        return read_record(tp, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise DecodertError(f"{where} must be a list")
        return tuple(read_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict):
        if not isinstance(value, dict):
            raise DecodertError(f"{where} must be an object")
        return types.MappingProxyType({k: read_value(args[1], v, f"{where}.{k}") for k, v in value.items()})
    if not _is(tp, value):
        raise DecodertError(f"{where} must be {_name(tp)}")
    return float(value) if tp is float else value


def _is(tp: Any, value: Any) -> bool:
    if tp is int:
        return type(value) is int
    if tp is float:
        return type(value) in (int, float)
    return type(value) is tp


def _name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(tp, "an object" if isinstance(tp, type) and issubclass(tp, Record) else str(tp))


def to_json(value: Any) -> Any:
    """A record (or a value inside one) -> plain JSON values; ``extra`` keys come back after the fields."""
    if isinstance(value, Record):
        out = {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "extra"
               and not (f.metadata.get("omit_null") and getattr(value, f.name) is None)}
        out.update({k: v for k, v in value.extra.items() if k not in out})
        return out
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    return value
