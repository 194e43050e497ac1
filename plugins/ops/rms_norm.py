"""RMSNorm (optionally fused with the residual add), defined once.

    y = x / sqrt(mean(x^2, axis=-1) + eps) * weight         (computed in float32)
    fused:  s = x + residual;  y = rmsnorm(s);  outputs (y, s)
    unfused: the optional second output is x itself (s = x), so a node may always declare two
    outputs: TensorRT plugins have a fixed output count and cannot see how many inputs a node has.
"""

from __future__ import annotations

import numpy as np

from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.registry import OpDef, register


def rms_norm_ref(x: np.ndarray, weight: np.ndarray, residual: np.ndarray | None = None, *, epsilon: float):
    s = x if residual is None else (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
    xf = s.astype(np.float32)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + epsilon)
    y = (y.astype(x.dtype) * weight).astype(x.dtype)
    return y, s


def rms_norm_body(g: GraphBuilder, x: str, weight: str, *, epsilon: float, dtype: str, out: str | None = None) -> str:
    """Standard ONNX ops (opset >= 18), float32 inside."""
    xf = g.op("Cast", x, to=1) if dtype != "fp32" else x
    ms = g.op("ReduceMean", g.op("Mul", xf, xf), g.const(np.array([-1], np.int64)), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(np.float32(epsilon)))))
    y = g.op("Mul", xf, inv)
    if dtype != "fp32":
        y = g.op("Cast", y, to=DTYPES[dtype])
    return g.op("Mul", y, weight, outputs=[out])[0]



def rms_norm_shapes(ins: list, attrs: dict, const) -> list:
    """y and sum have x's shape."""
    return [list(ins[0]), list(ins[0])]


def rms_norm_expand(g: GraphBuilder, inputs, outputs, attrs: dict, ctx) -> None:
    """decodert::RMSNorm -> (Add) + the body above; ``sum`` is the Add's output."""
    x, weight = inputs[0], inputs[1]
    residual = inputs[2] if len(inputs) > 2 and inputs[2] else None
    total = outputs[1] if len(outputs) > 1 and outputs[1] else None
    if residual is not None:
        x = g.op("Add", x, residual, outputs=[total])[0]
    elif total is not None:
        g.op("Identity", x, outputs=[total])
    rms_norm_body(g, x, weight, epsilon=float(attrs["epsilon"]), dtype=ctx.dtype(weight), out=outputs[0])


RMS_NORM = register(
    OpDef(
        name="RMSNorm",
        inputs=("x: T [..., N]", "weight: T [N]", "residual: T [..., N] (optional)"),
        outputs=("y: T [..., N]", "sum: T [..., N] (x + residual; x without residual)"),
        attributes={"epsilon": 1e-6},
        numpy_ref=rms_norm_ref,
        shape_rule=rms_norm_shapes,
        body=rms_norm_expand,
        type_input=1,
        doc=__doc__ or "",
    )
)
