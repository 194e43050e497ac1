"""expand_plugin_nodes(model): replace every ``decodert::X`` node by its reference body.

    ... -> [decodert::CachedAttention] -> ...      becomes      ... -> [Reshape, Gather, ...,
                                                                       ScatterND -> present_*,
                                                                       MatMul, Softmax, ...] -> ...

The body's nodes take the plugin node's place (topological order kept) and write the node's
output names, so graph outputs (``present_key.i``: the cache written in place) keep their
names. Initializers stay where they are (external data is not loaded). The default-domain
opset is raised to what the bodies need (18, or 21 for MatMulNBits) and the ``decodert``
opset import is dropped. Unknown ops or attributes raise DecodertError naming the node.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper

from decodert.errors import DecodertError
from decodert.plugins.onnx_builder import DTYPE_NAMES, GraphBuilder
from decodert.plugins.catalog import get_op
from decodert.plugins.registry import DOMAIN

BODY_OPSET = 18  # ReduceMean/Split with axes/split inputs, Shape start/end


class ExpandContext:
    """What a body may ask about the graph: element types, static dims, opset needs."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.node_name = "?"
        self.opset = BODY_OPSET
        self._types: dict[str, int] = {}
        self._shapes: dict[str, list[Any]] = {}
        self._inferred = False
        self._collect(model.graph)

    def _collect(self, graph: onnx.GraphProto) -> None:
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            t = vi.type.tensor_type
            self._types.setdefault(vi.name, t.elem_type)
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
            self._shapes.setdefault(vi.name, dims)
        for init in graph.initializer:
            self._types[init.name] = init.data_type
            self._shapes[init.name] = list(init.dims)

    def _infer(self) -> None:
        """Run ONNX shape inference once, for values the graph does not annotate."""
        if not self._inferred:
            self._inferred = True
            try:
                self._collect(onnx.shape_inference.infer_shapes(self.model).graph)
            except Exception:  # noqa: BLE001 - inference is a best effort here
                pass

    def error(self, message: str) -> DecodertError:
        return DecodertError(f"node {self.node_name}: {message}")

    def dtype(self, name: str) -> str:
        """"fp32" | "fp16" | "bf16" of a value."""
        if name not in self._types:
            self._infer()
        elem = self._types.get(name)
        if DTYPE_NAMES.get(elem) not in ("fp32", "fp16", "bf16"):
            raise self.error(f"cannot tell the float type of '{name}' (got {elem}); annotate it in the graph")
        return DTYPE_NAMES[elem]

    def static_dim(self, name: str, axis: int) -> int:
        if name not in self._shapes:
            self._infer()
        dims = self._shapes.get(name) or []
        if axis >= len(dims) or not isinstance(dims[axis], int) or dims[axis] <= 0:
            raise self.error(f"'{name}' needs a static dimension {axis} (shape {dims or 'unknown'})")
        return dims[axis]

    def set_type(self, name: str, elem: int) -> None:
        self._types[name] = elem

    def require_opset(self, version: int) -> None:
        self.opset = max(self.opset, version)


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        out[a.name] = value.decode() if isinstance(value, bytes) else value
    return out


def _expand_node(g: GraphBuilder, node: onnx.NodeProto, ctx: ExpandContext) -> None:
    name = node.name or f"<unnamed {node.op_type}>"
    op = get_op(node.op_type, name)
    attrs = op.check_attributes(name, _attributes(node))
    op.check_arity(name, list(node.input), list(node.output))
    if op.body is None:
        raise DecodertError(f"node {name}: {DOMAIN}::{op.name} has no reference body")
    ctx.node_name = name
    with g.scope((node.name or node.op_type).strip("/") + "/expanded"):
        op.body(g, list(node.input), list(node.output), attrs, ctx)
    t = ctx._types.get(node.input[op.type_input])
    for out_name in node.output:  # bodies keep T: later plugin nodes can ask for it
        if out_name and t is not None:
            ctx.set_type(out_name, t)


def _unique_constants(g: GraphBuilder, taken: set[str]) -> dict[str, str]:
    """Rename the builder's constants (const_0, ...) away from names the graph already uses."""
    renames = {}
    for old in list(g.initializers):
        new, k = f"decodert_expand/{old}", 0
        while new in taken:
            k += 1
            new = f"decodert_expand/{old}_{k}"
        renames[old] = new
    return renames


def expand_plugin_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every decodert-domain node replaced by standard ONNX ops."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    if not any(n.domain == DOMAIN for n in graph.node):
        return out
    ctx = ExpandContext(model)
    opsets = {o.domain: o.version for o in model.opset_import}
    g = GraphBuilder(graph.name, opsets)
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain != DOMAIN:
            new_nodes.append(node)
            continue
        start = len(g.nodes)
        _expand_node(g, node, ctx)
        new_nodes.extend(g.nodes[start:])
    taken = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    taken |= {o for n in new_nodes for o in n.output}
    renames = _unique_constants(g, taken)
    for n in g.nodes:  # only the bodies' nodes refer to the builder's constants
        for i, name in enumerate(n.input):
            if name in renames:
                n.input[i] = renames[name]
    for old, tensor in g.initializers.items():
        tensor.name = renames[old]
        graph.initializer.append(tensor)
    del graph.node[:]
    graph.node.extend(new_nodes)
    _set_opsets(out, max(opsets.get("", 1), ctx.opset))
    return out


def _set_opsets(model: onnx.ModelProto, version: int) -> None:
    keep = [o for o in model.opset_import if o.domain not in ("", "ai.onnx", DOMAIN)]
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", version), *keep])
    model.ir_version = max(model.ir_version, 10 if version >= 21 else 8)


def expand_file(src: str, dst: str) -> None:
    """Expand an ONNX file whose weights stay in external data next to it (``dst`` beside ``src``)."""
    model = onnx.load(src, load_external_data=False)
    onnx.save(expand_plugin_nodes(model), dst)

