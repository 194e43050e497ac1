"""decodert ops, each defined once: schema, numpy reference, reference ONNX body.

A plugin node in a graph (domain ``decodert``) can always be expanded into its reference body
of standard ONNX ops (:func:`expand_plugin_nodes`), so any ONNX runtime runs the graph; fast
targets lower the same op to runtime-specific ops or a GPU kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from decodert.errors import DecodertError

DOMAIN = "decodert"


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]  # "name: type [shape]" lines, for docs and the ONNX schema
    outputs: tuple[str, ...]
    attributes: dict[str, Any]  # attribute name -> default (None = required)
    numpy_ref: Callable[..., Any]  # (*arrays, **attrs) -> tuple of arrays
    doc: str = ""
    input_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_names", tuple(s.split(":")[0].strip() for s in self.inputs))

    def check_attributes(self, node_name: str, attrs: dict[str, Any]) -> dict[str, Any]:
        """Attributes with defaults filled in; unknown or missing ones name the node."""
        unknown = set(attrs) - set(self.attributes)
        if unknown:
            raise DecodertError(f"node {node_name}: unknown attribute(s) {sorted(unknown)} for {DOMAIN}::{self.name}")
        out = {k: attrs.get(k, v) for k, v in self.attributes.items()}
        missing = [k for k, v in out.items() if v is None]
        if missing:
            raise DecodertError(f"node {node_name}: missing attribute(s) {missing} for {DOMAIN}::{self.name}")
        return out


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    OPS[op.name] = op
    return op


def get_op(name: str, node_name: str = "?") -> OpDef:
    if name not in OPS:
        raise DecodertError(f"node {node_name}: unknown op {DOMAIN}::{name}; known: {', '.join(sorted(OPS))}")
    return OPS[name]
