"""``vision.onnx`` of the ``qwen_vit`` tower (Qwen2.5-VL), one image per call, in standard ONNX ops.

The runtime (runtime/vision/qwen_preprocess.py) gives the patches already in window order, as transformers
permutes them (get_vision_window_index), with each patch's (row, column) and window; the graph's output
rows are in that order too and the runtime puts them back:

    pixel_values    [P, 3 T p p] fp32   patch rows (window order)
    patch_positions [P, 2] int64        (row, column) of each patch in the image's patch grid
    patch_windows   [P] int64           the window each patch belongs to
      x = pixel_values @ patch_embed^T                       [P, C]   (the Conv3d as a linear)
      cos, sin = 2-D rotary: angles (row * f | column * f) twice, f = theta^(-4k/D)   [P, D]
    per layer i:
        h = rmsnorm(x);  q, k, v = split(h @ qkv^T + b)        [H, P, D] each; q, k rotated (rotate-half)
        attn = softmax(q k^T / sqrt(D) + mask) v               mask: -inf across windows, none in full_layers
        x = x + attn @ o^T + b
        x = x + down(silu(gate) * up)(rmsnorm(x))              gate | up from one GEMM, with biases
    merger: rmsnorm(x) -> [P / r^2, C r^2] -> fc1 -> gelu (erf) -> fc2   image_embeds [P / r^2, hidden]
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from decodert.export.artifact.weights import NUMPY_DTYPES
from decodert.models.vision import VisionSpec
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.rms_norm import rms_norm_body

OPSET = 18  # ReduceMean with axes as an input (the RMSNorm body)


def qwen_contract(v: VisionSpec, dtype: str) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of the tower's inputs and output (also written to the manifest)."""
    return {"inputs": [{"name": "pixel_values", "dtype": "fp32", "shape": ["patches", v.patch_features]},
                       {"name": "patch_positions", "dtype": "int64", "shape": ["patches", 2]},
                       {"name": "patch_windows", "dtype": "int64", "shape": ["patches"]}],
            "outputs": [{"name": "image_embeds", "dtype": dtype, "shape": ["image_tokens", v.out_hidden]}]}


def build_qwen_vision(v: VisionSpec, dtype: str, weights: dict[str, onnx.TensorProto],
                      ir_version: int = 10) -> onnx.ModelProto:
    g = GraphBuilder("decodert_vision_qwen", {"": OPSET})
    contract = qwen_contract(v, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for tensor in weights.values():
        g.add_initializer(tensor)
    np_dtype = NUMPY_DTYPES[dtype]
    with g.scope("vision"):
        pixels = "pixel_values" if dtype == "fp32" else g.op("Cast", "pixel_values", to=DTYPES[dtype])
        x = g.op("Gemm", pixels, "vision.patch_embed", transB=1)  # [P, C]
        with g.scope("rotary"):
            cos, sin = _rotary(g, v, np_dtype)
        with g.scope("window_mask"):
            same = g.op("Equal", g.op("Unsqueeze", "patch_windows", g.const([1])),
                        g.op("Unsqueeze", "patch_windows", g.const([0])))  # [P, P]
            mask = g.op("Where", same, g.const(np.array(0, np_dtype)), g.const(np.array(-1e4 if dtype == "fp16"
                                                                                        else -1e9, np_dtype)))
        for i in range(v.num_layers):
            with g.scope(f"layers.{i}"):
                x = _layer(g, v, f"vision.layers.{i}.", x, cos, sin, None if i in v.full_layers else mask,
                           dtype, np_dtype)
        with g.scope("merger"):
            x = rms_norm_body(g, x, "vision.merger_norm", epsilon=1e-6, dtype=dtype)
            x = g.op("Reshape", x, g.const([-1, v.hidden_size * v.scale_factor ** 2]))
            x = _gelu_erf(g, g.op("Gemm", x, "vision.merger_fc1", "vision.merger_fc1_bias", transB=1), np_dtype)
            x = g.op("Gemm", x, "vision.merger_fc2", "vision.merger_fc2_bias", transB=1)
    g.output(x, "image_embeds", dtype, contract["outputs"][0]["shape"])
    return g.to_model(ir_version=ir_version)


def _rotary(g: GraphBuilder, v: VisionSpec, np_dtype: type) -> tuple[str, str]:
    """cos, sin [1, P, D] of the 2-D rotary (transformers' axial rope: rows then columns, repeated)."""
    d = v.hidden_size // v.num_heads
    quarter = np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2)
    inv = (1.0 / (v.rope_theta ** quarter)).astype(np.float32)  # [D/4]
    pos = g.op("Cast", "patch_positions", to=1)  # [P, 2] float32
    angles = g.op("Mul", g.op("Unsqueeze", pos, g.const([2])), g.const(inv.reshape(1, 1, -1)))  # [P, 2, D/4]
    half = g.op("Reshape", angles, g.const([-1, d // 2]))  # rows' angles | columns' angles
    full = g.op("Unsqueeze", g.op("Concat", half, half, axis=-1), g.const([0]))  # [1, P, D]
    out = []
    for fn in ("Cos", "Sin"):
        t = g.op(fn, full)
        out.append(t if np_dtype == np.float32 else g.op("Cast", t, to=onnx.helper.np_dtype_to_tensor_dtype(
            np.dtype(np_dtype))))
    return out[0], out[1]


def _rotate(g: GraphBuilder, x: str, cos: str, sin: str, d: int) -> str:
    """x [H, P, D] -> x cos + rotate_half(x) sin."""
    x1 = g.op("Slice", x, g.const([0]), g.const([d // 2]), g.const([2]))
    x2 = g.op("Slice", x, g.const([d // 2]), g.const([d]), g.const([2]))
    rot = g.op("Concat", g.op("Neg", x2), x1, axis=2)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))


def _layer(g: GraphBuilder, v: VisionSpec, p: str, x: str, cos: str, sin: str, mask: str | None, dtype: str,
           np_dtype: type) -> str:
    c, heads = v.hidden_size, v.num_heads
    d = c // heads
    with g.scope("attn"):
        h = rms_norm_body(g, x, p + "norm1", epsilon=1e-6, dtype=dtype)
        qkv = g.op("Gemm", h, p + "qkv", p + "qkv_bias", transB=1)  # [P, 3C]
        qkv = g.op("Transpose", g.op("Reshape", qkv, g.const([-1, 3, heads, d])), perm=[1, 2, 0, 3])  # [3, H, P, D]
        q, k, vv = (g.op("Squeeze", part, g.const([0])) for part in
                    g.op("Split", qkv, g.const([1, 1, 1]), axis=0, outputs=3))
        q, k = _rotate(g, q, cos, sin, d), _rotate(g, k, cos, sin, d)
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 2, 1])),
                      g.const(np.array(1 / math.sqrt(d), np_dtype)))  # [H, P, P]
        if mask is not None:
            scores = g.op("Add", scores, mask)
        ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), vv)  # [H, P, D]
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[1, 0, 2]), g.const([-1, c]))
        x = g.op("Add", x, g.op("Gemm", ctx, p + "o", p + "o_bias", transB=1))
    with g.scope("mlp"):
        h = rms_norm_body(g, x, p + "norm2", epsilon=1e-6, dtype=dtype)
        gate, up = g.op("Split", g.op("Gemm", h, p + "gate_up", p + "gate_up_bias", transB=1),
                        g.const([v.intermediate_size] * 2), axis=-1, outputs=2)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        x = g.op("Add", x, g.op("Gemm", act, p + "down", p + "down_bias", transB=1))
    return x


def _gelu_erf(g: GraphBuilder, x: str, np_dtype: type) -> str:
    """0.5 x (1 + erf(x / sqrt 2)): torch's nn.GELU()."""
    k = lambda value: g.const(np.array(value, np_dtype))  # noqa: E731
    return g.op("Mul", g.op("Mul", x, k(0.5)), g.op("Add", g.op("Erf", g.op("Mul", x, k(1 / math.sqrt(2)))), k(1.0)))
