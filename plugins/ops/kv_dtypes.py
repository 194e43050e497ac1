"""KV cache element types (``--kv-dtype``) and the Q/DQ bodies that store K/V in them.

    name   stored as            bytes/elem   scale
    fp32   float                4            -
    fp16   float16              2            -     (a Cast when the model's dtype differs)
    bf16   bfloat16             2            -
    int8   int8                 1            per channel: round(x / s) clipped to [-128, 127]
    fp8    float8e4m3fn         1            per channel: x / s saturated to +-448
    int4   uint8, 2 per byte    0.5          per channel: round(x / s) clipped to [-8, 7], +8, low nibble first

A quantized cache has one float32 scale per layer, per K and V, per (kv head, channel):
``kv_scale.key.{i}`` / ``kv_scale.value.{i}`` [1, Hkv, 1, D], calibrated at export
(export/quantize/kv_calibrate.py). The int8 and int4 codes are exactly what ONNX Runtime's
GroupQueryAttention writes with ``k_quant_type=PER_CHANNEL`` (checked in tests/export/test_kv_dtype.py), so
its graphs and the standard-op bodies below (the portable target, ort's verify graph) share one cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto

from decodert.errors import DecodertError
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder


@dataclass(frozen=True)
class KVDtype:
    name: str  # --kv-dtype
    storage: str  # the cache tensors' element type (plugins/onnx_builder.DTYPES)
    bits: int  # per element
    qmax: float = 0.0  # quantized: the largest magnitude a code holds (0 = a float cache)

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    def width(self, head_dim: int) -> int:
        """The cache's last dimension: head_dim elements, two per byte at 4 bits."""
        return head_dim * self.bits // 8 if self.bits == 4 else head_dim

    def bytes_per_position(self, head_dim: int) -> int:
        """Bytes of one position of one head."""
        return head_dim * self.bits // 8


NUMPY_STORAGE = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16),
                 "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
KV_DTYPES: dict[str, KVDtype] = {k.name: k for k in (
    KVDtype("fp32", "fp32", 32), KVDtype("fp16", "fp16", 16), KVDtype("bf16", "bf16", 16),
    KVDtype("int8", "int8", 8, 127.0), KVDtype("fp8", "fp8", 8, 448.0), KVDtype("int4", "uint8", 4, 7.0))}


def kv_dtype(name: str | None, model_dtype: str) -> KVDtype:
    """``--kv-dtype`` (None: the model's dtype), or a one-line error."""
    name = model_dtype if name is None else name
    if name not in KV_DTYPES:
        raise DecodertError(f"unknown --kv-dtype '{name}'; choose one of: {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def scale_names(past: str) -> str:
    """The scale of cache input ``past_key.3`` -> ``kv_scale.key.3``."""
    return past.replace("past_", "kv_scale.", 1)


def _f32(g: GraphBuilder, x: str, dtype: str) -> str:
    return x if dtype == "fp32" else g.op("Cast", x, to=TensorProto.FLOAT)


def store_body(g: GraphBuilder, x: str, scale: str, kv: KVDtype, dtype: str) -> str:
    """New K/V ``x`` [B,Hkv,S,D] in the model's ``dtype`` -> the cache's element type ([B,Hkv,S,width])."""
    if not kv.quantized:
        return x if kv.storage == dtype else g.op("Cast", x, to=DTYPES[kv.storage])
    y = g.op("Div", _f32(g, x, dtype), scale)
    if kv.name == "fp8":
        zero = g.const(np.zeros((), np.float32))  # a float8 zero point fixes QuantizeLinear's output type
        return g.op("QuantizeLinear", y, g.const(np.float32(1.0)), g.op("Cast", zero, to=TensorProto.FLOAT8E4M3FN))
    lo, hi = -kv.qmax - 1, kv.qmax
    q = g.op("Clip", g.op("Round", y), g.const(np.float32(lo)), g.const(np.float32(hi)))
    if kv.bits == 8:
        return g.op("Cast", q, to=TensorProto.INT8)
    u = g.op("Cast", g.op("Add", q, g.const(np.float32(8.0))), to=TensorProto.UINT8)  # 0..15
    pairs = g.op("Reshape", u, g.const([0, 0, 0, -1, 2]))  # [B,Hkv,S,D/2,2]
    even, odd = (g.op("Gather", pairs, g.const(np.int64(i)), axis=4) for i in (0, 1))
    return g.op("BitwiseOr", even, g.op("BitShift", odd, g.const(np.uint8(4)), direction="LEFT"))


def load_body(g: GraphBuilder, cache: str, scale: str, kv: KVDtype, dtype: str) -> str:
    """Cache positions [B,Hkv,T,width] -> K/V [B,Hkv,T,D] in the model's ``dtype``."""
    if not kv.quantized:
        return cache if kv.storage == dtype else g.op("Cast", cache, to=DTYPES[dtype])
    if kv.bits == 4:
        low = g.op("BitwiseAnd", cache, g.const(np.uint8(15)))
        high = g.op("BitShift", cache, g.const(np.uint8(4)), direction="RIGHT")
        pairs = g.op("Concat", *(g.op("Unsqueeze", n, g.const([4])) for n in (low, high)), axis=4)
        codes = g.op("Reshape", pairs, g.const([0, 0, 0, -1]))  # [B,Hkv,T,D]
        q = g.op("Sub", g.op("Cast", codes, to=TensorProto.FLOAT), g.const(np.float32(8.0)))
    else:
        q = g.op("Cast", cache, to=TensorProto.FLOAT)
    y = g.op("Mul", q, scale)
    return y if dtype == "fp32" else g.op("Cast", y, to=DTYPES[dtype])
