"""decodert ops, each defined once: schema, shape rule, numpy reference, reference ONNX body.

A plugin node in a graph (domain ``decodert``) can always be expanded into its reference body
of standard ONNX ops (:func:`decodert.plugins.expand.expand_plugin_nodes`), so any ONNX runtime
runs the graph; fast targets lower the same op to runtime-specific ops, native TensorRT layers
or a GPU kernel behind a TensorRT plugin (:mod:`decodert.plugins.trt.creators`).

Shape rules are written once over an abstract dimension type, so the same function gives
integer shapes in tests and ``IDimensionExpr`` shapes inside the TensorRT plugin:

    rule(in_shapes: list[list[D]], attrs: dict, const: Callable[[int], D]) -> list[list[D]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from decodert.errors import DecodertError

DOMAIN = "decodert"
OPSET_VERSION = 1

# body(g, inputs, outputs, attrs, ctx): add standard nodes computing ``outputs`` from ``inputs``
# ("" = optional input absent); ctx is an expand.ExpandContext (dtypes, shared per-graph values).
Body = Callable[..., None]
ShapeRule = Callable[[list, dict, Callable[[int], Any]], list]


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]  # "name: type [shape]" lines; "(optional)" marks optional inputs
    outputs: tuple[str, ...]
    attributes: dict[str, Any]  # attribute name -> default (None = required)
    numpy_ref: Callable[..., Any]  # (*arrays, **attrs) -> tuple of arrays
    shape_rule: ShapeRule | None = None
    body: Body | None = None
    type_input: int = 0  # the input whose element type is the op's T
    min_outputs: int = 1  # trailing outputs may be left out
    aliases: dict[int, int] = field(default_factory=dict)  # output index -> input whose buffer it reuses
    doc: str = ""
    input_names: tuple[str, ...] = field(init=False)
    required_inputs: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_names", tuple(s.split(":")[0].strip() for s in self.inputs))
        required = [i for i, s in enumerate(self.inputs) if "(optional)" not in s]
        object.__setattr__(self, "required_inputs", (required[-1] + 1) if required else 0)

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

    def check_arity(self, node_name: str, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        """Input/output counts against the schema (optional inputs may be "" or left off)."""
        n = self.required_inputs
        if not n <= len(inputs) <= len(self.inputs) or not all(inputs[:n]):
            names = ", ".join(self.input_names)
            raise DecodertError(f"node {node_name}: {DOMAIN}::{self.name} takes inputs ({names}), the first {n} "
                                f"required; got {list(inputs)}")
        if not self.min_outputs <= len(outputs) <= len(self.outputs):
            raise DecodertError(f"node {node_name}: {DOMAIN}::{self.name} has {self.min_outputs}..{len(self.outputs)} "
                                f"outputs; got {len(outputs)}")

    def attr_type(self, name: str) -> type:
        """int, float or str: the default's type (required attributes are ints)."""
        default = self.attributes[name]
        return int if default is None else type(default)

    def io_type(self, index: int, output: bool = False) -> str:
        """The schema's element type token of an input/output: "T", "int64", "uint8"."""
        return (self.outputs if output else self.inputs)[index].split(":")[1].split()[0]

    def output_shapes(self, in_shapes: list, attrs: dict[str, Any], const: Callable[[int], Any] = int) -> list:
        if self.shape_rule is None:
            raise DecodertError(f"{DOMAIN}::{self.name} has no shape rule")
        return self.shape_rule(in_shapes, attrs, const)


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    OPS[op.name] = op
    return op

