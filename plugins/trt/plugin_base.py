"""DecodertPlugin: one IPluginV3 class serving every decodert op, driven by the op's definition.

    core     name / namespace / version; fields = the op's attributes
    build    output dtypes ("T" = input 0's type), shapes (the op's shape rule over
             IDimensionExpr), formats (linear; the schema's types), aliased outputs
             (CachedAttention's present_* reuse the past_* buffers: the in-place cache)
    runtime  enqueue -> plugins/trt/enqueue.py (Triton kernels on TensorRT's stream)

Made per TensorRT module (``tensorrt`` or ``tensorrt_rtx_bindings``): the bases come from it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from decodert.plugins.registry import OpDef


def _types(trt: ModuleType) -> tuple[set, dict[str, Any]]:
    floats = {trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16}
    fixed = {"int64": trt.DataType.INT64, "int32": trt.DataType.INT32, "uint8": trt.DataType.UINT8}
    return floats, fixed


def make_plugin_class(trt: ModuleType) -> type:
    floats, fixed = _types(trt)
    bases = (trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2, trt.IPluginV3OneRuntime)

    class DecodertPlugin(*bases):  # type: ignore[misc]
        def __init__(self, trt_module: ModuleType, op: OpDef, attrs: dict[str, Any], namespace: str):
            for base in bases:
                base.__init__(self)
            self.op, self.attrs = op, dict(attrs)
            self.plugin_name, self.plugin_namespace, self.plugin_version = op.name, namespace, "1"
            self.num_outputs = len(op.outputs)
            self.timing_cache_id = ""
            self.namespace = namespace

        # ---- core / lifecycle
        def get_capability_interface(self, kind: Any) -> Any:
            return self

        def clone(self) -> Any:
            return DecodertPlugin(trt, self.op, self.attrs, self.namespace)

        def attach_to_context(self, context: Any) -> Any:
            return self.clone()

        def get_fields_to_serialize(self) -> Any:
            return plugin_fields(trt, self.op, self.attrs)

        # ---- build
        def get_output_data_types(self, input_types: list) -> list:
            return [input_types[0]] * self.num_outputs

        def get_output_shapes(self, inputs: list, shape_inputs: list, exprs: Any) -> list:
            dims = [[d[i] for i in range(len(d))] for d in inputs]
            shapes = self.op.output_shapes(dims, self.attrs, exprs.constant)
            return [trt.DimsExprs(s) for s in shapes[: self.num_outputs]]

        def supports_format_combination(self, pos: int, in_out: list, num_inputs: int) -> bool:
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            is_out = pos >= num_inputs
            token = self.op.io_type(pos - num_inputs if is_out else pos, output=is_out)
            if token != "T":
                return desc.type == fixed[token]
            return desc.type in floats if pos == 0 else desc.type == in_out[0].desc.type

        def configure_plugin(self, inputs: list, outputs: list) -> None:
            return None

        def on_shape_change(self, inputs: list, outputs: list) -> None:
            return None

        def get_workspace_size(self, inputs: list, outputs: list) -> int:
            from decodert.plugins.trt.enqueue import workspace_bytes

            return workspace_bytes(trt, self.op.name, [list(i.max) for i in inputs], inputs[0].desc.type)

        def get_aliased_input(self, output_index: int) -> int:
            return self.op.aliases.get(output_index, -1)

        def get_valid_tactics(self) -> list:
            return []

        def set_tactic(self, tactic: int) -> None:
            return None

        # ---- runtime
        def enqueue(self, input_desc: list, output_desc: list, inputs: list, outputs: list, workspace: int,
                    stream: int) -> None:
            from decodert.plugins.trt.enqueue import enqueue

            enqueue(trt, self.op.name, self.attrs, input_desc, output_desc, inputs, outputs, workspace, stream)

    return DecodertPlugin


# ---------------------------------------------------------------- fields <-> attributes
def plugin_fields(trt: ModuleType, op: OpDef, attrs: dict[str, Any] | None) -> Any:
    """A PluginFieldCollection of the op's attributes (values, or empty ones naming the types)."""
    fields = []
    for name in op.attributes:
        typ = op.attr_type(name)
        if typ is float:
            data, kind = np.array([] if attrs is None else [attrs[name]], np.float32), trt.PluginFieldType.FLOAT32
        else:
            data, kind = np.array([] if attrs is None else [attrs[name]], np.int32), trt.PluginFieldType.INT32
        fields.append(trt.PluginField(name, data, kind))
    return trt.PluginFieldCollection(fields)


def attrs_from_fields(op: OpDef, node_name: str, fc: Any) -> dict[str, Any]:
    given = {}
    for f in fc:
        if f.name in op.attributes and len(f.data):
            given[f.name] = op.attr_type(f.name)(f.data[0])
    return op.check_attributes(node_name, given)
