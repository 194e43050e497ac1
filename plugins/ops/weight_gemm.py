"""MatMulNBits: weight-only int4/int8 GEMM, y = a @ dequant(b)^T, defined once.

Layout (the same bytes as ONNX Runtime's com.microsoft.MatMulNBits, so one packed tensor
serves both; n_blocks = K / block_size):

    a            T     [..., K]
    b            uint8 [N, n_blocks, block_size * bits / 8]   row n, block j, packed codes;
                                                               4-bit: element 2i in the low
                                                               nibble of byte i, 2i+1 high
    scales       T     [N, n_blocks]
    zero_points  uint8 [N, ceil(n_blocks * bits / 8)]         packed like b (optional;
                                                               default 2^(bits-1): 8 or 128)
    y            T     [..., N]

    w[n, k] = (code[n, k] - zero[n, k // block_size]) * scales[n, k // block_size]

Reference body (standard ONNX, opset 21): BitwiseAnd/BitShift unpack the nibbles ->
DequantizeLinear(axis=1, block_size) -> MatMul(a, w^T). TensorRT (>= 10.0, also 10.3 on
JetPack 6) runs block DequantizeLinear + MatMul natively, so this op needs no TensorRT plugin;
ONNX Runtime runs com.microsoft.MatMulNBits on the same bytes.
"""

from __future__ import annotations

import numpy as np

from decodert.plugins.onnx_builder import GraphBuilder
from decodert.plugins.registry import OpDef, register

BITS = (4, 8)


# ---- numpy: unpack, reference (weights are quantized and packed by export/quantize/quant.py) ----------------------------------------------
def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Packed bytes [..., m] -> uint8 codes [..., m * 8 / bits] (low nibble first)."""
    if bits == 8:
        return packed.astype(np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0xF, packed >> 4
    return out


def zero_point_bytes(n_blocks: int, bits: int) -> int:
    return (n_blocks * bits + 7) // 8


def dequantize_ref(b, scales, zero_points=None, *, K: int, N: int, bits: int, block_size: int) -> np.ndarray:
    """The float32 weight w [N, K] the op multiplies by."""
    n_blocks = K // block_size
    codes = unpack_codes(np.asarray(b).reshape(N, -1), bits)[:, :K].astype(np.float32)
    if zero_points is None:
        zero = np.full((N, n_blocks), 1 << (bits - 1), np.float32)
    else:
        zero = unpack_codes(np.asarray(zero_points).reshape(N, -1), bits)[:, :n_blocks].astype(np.float32)
    scale = np.asarray(scales, np.float32).reshape(N, n_blocks)
    return (codes - np.repeat(zero, block_size, 1)) * np.repeat(scale, block_size, 1)


def matmul_nbits_ref(a, b, scales, zero_points=None, *, K, N, bits, block_size, accuracy_level=0):
    w = dequantize_ref(b, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size)
    y = a.astype(np.float32) @ w.astype(a.dtype).astype(np.float32).T
    return (y.astype(a.dtype),)


# ---- op: shape rule, reference body ---------------------------------------------------------
def matmul_nbits_shapes(ins: list, attrs: dict, const) -> list:
    """y [..., N]: a's shape with the last dim replaced by N."""
    return [list(ins[0][:-1]) + [const(int(attrs["N"]))]]


def _unpack_body(g: GraphBuilder, packed: str, bits: int, shape: list[int]) -> str:
    """uint8 packed [..., m] -> uint8 codes reshaped to ``shape`` (nibbles low first)."""
    if bits == 8:
        return g.op("Reshape", packed, g.const(shape))
    lo = g.op("BitwiseAnd", packed, g.const(np.array([0x0F], np.uint8)))
    hi = g.op("BitShift", packed, g.const(np.array([4], np.uint8)), direction="RIGHT")
    pairs = g.op("Concat", g.op("Unsqueeze", lo, g.const([-1])), g.op("Unsqueeze", hi, g.const([-1])), axis=-1)
    return g.op("Reshape", pairs, g.const(shape))


def matmul_nbits_expand(g: GraphBuilder, inputs, outputs, attrs: dict, ctx) -> None:
    a, b, scales = inputs[:3]
    zero_points = inputs[3] if len(inputs) > 3 and inputs[3] else None
    k, n, bits, bs = (int(attrs[key]) for key in ("K", "N", "bits", "block_size"))
    if bits not in BITS or bs < 16 or bs & (bs - 1) or k % bs:
        raise ctx.error(f"bits={bits} must be 4 or 8 and block_size={bs} a power of two >= 16 dividing K={k}")
    ctx.require_opset(21)  # DequantizeLinear with block_size
    n_blocks = k // bs
    codes = _unpack_body(g, b, bits, [n, k])  # [N, K] uint8
    if zero_points is None:
        zero = g.const(np.full((n, n_blocks), 1 << (bits - 1), np.uint8))
    else:
        per_row = zero_point_bytes(n_blocks, bits) * 8 // bits
        zero = _unpack_body(g, zero_points, bits, [n, per_row])
        if per_row != n_blocks:
            zero = g.op("Slice", zero, g.const([0]), g.const([n_blocks]), g.const([1]))
    scale = g.op("Reshape", scales, g.const([n, n_blocks]))
    w = g.op("DequantizeLinear", codes, scale, zero, axis=1, block_size=bs)  # [N, K] T
    g.op("MatMul", a, g.op("Transpose", w, perm=[1, 0]), outputs=[outputs[0]])


MATMUL_NBITS = register(
    OpDef(
        name="MatMulNBits",
        inputs=("a: T [..., K]", "b: uint8 [N, K/block_size, block_size*bits/8]", "scales: T [N, K/block_size]",
                "zero_points: uint8 [N, ceil(K/block_size*bits/8)] (optional)"),
        outputs=("y: T [..., N]",),
        attributes={"K": None, "N": None, "bits": 4, "block_size": 32, "accuracy_level": 0},
        numpy_ref=matmul_nbits_ref,
        shape_rule=matmul_nbits_shapes,
        body=matmul_nbits_expand,
        type_input=2,
        doc=__doc__ or "",
    )
)
