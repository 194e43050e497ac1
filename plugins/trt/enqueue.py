"""What the decodert TensorRT plugins do at run time: Triton kernels on TensorRT's stream.

    CachedAttention  inputs  q k v [B,S,*]  past_key past_value [B,Hkv,Smax,D]  past_lengths [B]
                             cos sin [P,R/2]
                     outputs y [B,S,H*D], present_key/value (= the past buffers: TensorRT aliases them;
                             if it ever hands other buffers, the past is copied over first)
                     scratch q_rot [B,S,H,D] + split partials, carved from TensorRT's workspace
    RMSNorm          inputs x [..., N], weight [N] (, residual) -> y (, sum)

Only imported when an engine runs (needs Triton and a GPU); the workspace size is computed at
build time from the profile's max shapes with the same layout function.
"""

from __future__ import annotations

from math import prod
from types import ModuleType
from typing import Any

from decodert.plugins.kernels.dtypes import ELEMENT_BYTES

_NAMES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
          "UINT8": "uint8"}


def dtype_name(trt_type: Any) -> str:
    return _NAMES[getattr(trt_type, "name", str(trt_type).split(".")[-1])]


def attention_dims(shapes: list[list[int]], attrs: dict[str, Any]) -> Any:
    from decodert.plugins.kernels.launch import Dims

    (b, s, _), (_, hkv, smax, d), half = shapes[0], shapes[3], shapes[6][1]
    return Dims(B=b, S=s, H=int(attrs["num_heads"]), HKV=hkv, D=d, SMAX=smax, HALF=half)


def workspace_bytes(trt: ModuleType, op: str, max_shapes: list[list[int]], dtype: Any) -> int:
    if op != "CachedAttention":
        return 0
    from decodert.plugins.kernels.decode_attention import num_splits
    from decodert.plugins.kernels.launch import workspace_layout

    dims = attention_dims(max_shapes, {"num_heads": max_shapes[0][2] // max_shapes[3][3]})
    return workspace_layout(dims, dtype_name(dtype), nsplit=num_splits(1, dims.HKV, dims.SMAX))["total"][1]


def _copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import runtime as cudart

    (err,) = cudart.cudaMemcpyAsync(dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
    if int(err):
        raise RuntimeError(f"cudaMemcpyAsync failed: {err}")


def _attention(attrs: dict[str, Any], shapes: list[list[int]], types: list[str], inputs: list, outputs: list,
               workspace: int, stream: int) -> None:
    from decodert.plugins.kernels.launch import DevPtr, cached_attention, on_stream, workspace_layout

    dims = attention_dims(shapes, attrs)
    t = types[0]
    for out, past in ((outputs[1], inputs[3]), (outputs[2], inputs[4])):
        if out != past:
            _copy(out, past, prod(shapes[3]) * ELEMENT_BYTES[t], stream)
    ptr = [DevPtr(p, types[i]) for i, p in enumerate(inputs)]
    layout = workspace_layout(dims, t)
    ws = DevPtr(workspace, t)
    scratch = {"q_rot": ws.offset(layout["q_rot"][0]), "part_acc": ws.offset(layout["part_acc"][0], "float32"),
               "part_ml": ws.offset(layout["part_ml"][0], "float32"), "nsplit": layout["nsplit"][0]}
    key, value = DevPtr(outputs[1], t), DevPtr(outputs[2], t)
    scale = float(attrs["scale"]) or dims.D ** -0.5
    with on_stream(stream):
        cached_attention(ptr[0], ptr[1], ptr[2], key, value, ptr[5], ptr[6], ptr[7], DevPtr(outputs[0], t), scratch,
                         dims=dims, scale=scale, window=int(attrs["sliding_window"]))


def _rms_norm(attrs: dict[str, Any], shapes: list[list[int]], types: list[str], inputs: list, outputs: list,
              stream: int) -> None:
    from decodert.plugins.kernels.launch import DevPtr, on_stream
    from decodert.plugins.kernels.rms_norm import rms_norm

    t, n = types[0], shapes[0][-1]
    ptr = [DevPtr(p, t) for p in inputs]
    out = [DevPtr(p, t) for p in outputs]
    fused = len(inputs) > 2
    with on_stream(stream):
        rms_norm(ptr[0], ptr[1], out[0], ptr[2] if fused else None, out[1] if fused else None,
                 rows=prod(shapes[0][:-1]), n=n, eps=float(attrs["epsilon"]))
        if not fused and len(outputs) > 1:  # no residual: sum = x
            _copy(outputs[1], inputs[0], prod(shapes[0]) * ELEMENT_BYTES[t], stream)


def enqueue(trt: ModuleType, op: str, attrs: dict[str, Any], input_desc: list, output_desc: list, inputs: list,
            outputs: list, workspace: int, stream: int) -> None:
    shapes = [list(d.dims) for d in input_desc]
    types = [dtype_name(d.type) for d in input_desc]
    if op == "CachedAttention":
        _attention(attrs, shapes, types, inputs, outputs, workspace, stream)
    elif op == "RMSNorm":
        _rms_norm(attrs, shapes, types, inputs, outputs, stream)
    else:
        raise RuntimeError(f"decodert plugin {op} has no TensorRT kernel")
