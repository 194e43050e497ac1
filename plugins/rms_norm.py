"""RMSNorm (optionally fused with the residual add), defined once.

    y = x / sqrt(mean(x^2, axis=-1) + eps) * weight         (computed in float32)
    fused:  s = x + residual;  y = rmsnorm(s);  outputs (y, s)
"""

from __future__ import annotations

import numpy as np

from decodert.export.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.registry import OpDef, register


def rms_norm_ref(x: np.ndarray, weight: np.ndarray, residual: np.ndarray | None = None, *, epsilon: float):
    s = x if residual is None else (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
    xf = s.astype(np.float32)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + epsilon)
    y = (y.astype(x.dtype) * weight).astype(x.dtype)
    return (y,) if residual is None else (y, s)


RMS_NORM = register(
    OpDef(
        name="RMSNorm",
        inputs=("x: T [..., N]", "weight: T [N]", "residual: T [..., N] (optional)"),
        outputs=("y: T [..., N]", "sum: T [..., N] (x + residual, when residual is given)"),
        attributes={"epsilon": 1e-6},
        numpy_ref=rms_norm_ref,
        doc=__doc__ or "",
    )
)


def rms_norm_body(g: GraphBuilder, x: str, weight: str, *, epsilon: float, dtype: str) -> str:
    """Standard ONNX ops (opset >= 18), float32 inside."""
    xf = g.op("Cast", x, to=1) if dtype != "fp32" else x
    ms = g.op("ReduceMean", g.op("Mul", xf, xf), g.const(np.array([-1], np.int64)), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(np.float32(epsilon)))))
    y = g.op("Mul", xf, inv)
    if dtype != "fp32":
        y = g.op("Cast", y, to=DTYPES[dtype])
    return g.op("Mul", y, weight)

