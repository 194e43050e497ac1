"""A small ONNX graph builder: nodes named by path, constants, external weights.

Node names follow the module path (``/model/layers.0/attn/qkv/Gemm``) so a profile or a
TensorRT layer list reads like the model. Output names are derived from the node name.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DTYPES = {
    "fp32": TensorProto.FLOAT,
    "fp16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "bool": TensorProto.BOOL,
    "int8": TensorProto.INT8,  # quantized KV caches (plugins/ops/kv_dtypes.py)
    "uint8": TensorProto.UINT8,
    "fp8": TensorProto.FLOAT8E4M3FN,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class GraphBuilder:
    def __init__(self, name: str, opsets: dict[str, int]):
        self.name = name
        self.opsets = dict(opsets)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, TensorProto] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}

    # ---- structure -------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def nested(self, name: str) -> "GraphBuilder":
        """A builder for a subgraph (an If branch) named ``name``, its node names continuing this one's scope."""
        body = GraphBuilder(name, self.opsets)
        body._scope = [*self._scope, name]
        return body

    def input(self, name: str, dtype: str, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, DTYPES[dtype], list(shape)))
        return name

    def output(self, value: str, name: str, dtype: str, shape: Sequence[int | str]) -> None:
        """Expose ``value`` as graph output ``name`` (an Identity renames when needed)."""
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"/output/{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, DTYPES[dtype], list(shape)))

    def op(self, op_type: str, *inputs: str, outputs: int | Sequence[str | None] = 1, domain: str = "", **attrs):
        """Add a node; returns its output name, or a list when ``outputs`` is > 1 or a list.

        ``outputs`` as a list names outputs explicitly (None = derive from the node name).
        """
        path = "/".join(self._scope)
        key = f"{path}/{op_type}"
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        node_name = f"/{key}" if n == 0 else f"/{key}_{n}"
        count = outputs if isinstance(outputs, int) else len(outputs)
        derived = [f"{node_name}_out{k}" if count > 1 else f"{node_name}_out" for k in range(count)]
        names = derived if isinstance(outputs, int) else [n if n is not None else d for n, d in zip(outputs, derived)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        inputs = list(inputs)
        while inputs and inputs[-1] == "":  # trailing optional inputs left out
            inputs.pop()
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, domain=domain, **attrs))
        return names[0] if len(names) == 1 and isinstance(outputs, int) else names

    # ---- data ------------------------------------------------------------------------------
    def const(self, value: np.ndarray | int | float | Sequence[int], dtype: type | None = None) -> str:
        """A small constant initializer, deduplicated by value."""
        arr = np.asarray(value, dtype=dtype if dtype is not None else None)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = f"const_{len(self._consts)}"
            self.initializers[name] = numpy_helper.from_array(arr, name)
            self._consts[key] = name
        return self._consts[key]

    def add_initializer(self, tensor: TensorProto) -> str:
        self.initializers[tensor.name] = tensor
        return tensor.name

    def to_model(self, ir_version: int = 10, producer: str = "decodert") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, list(self.initializers.values()))
        opset_imports = [helper.make_opsetid(d, v) for d, v in self.opsets.items()]
        model = helper.make_model(graph, opset_imports=opset_imports, producer_name=producer)
        model.ir_version = ir_version
        return model
