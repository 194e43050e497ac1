"""``vision.onnx`` of the ``qwen_vit`` (Qwen2.5-VL) and ``qwen3_vit`` (Qwen3-VL) towers, one image per call,
in standard ONNX ops but the attention: the target lowering's ``encoder_attention`` (ort: MultiHeadAttention).

The runtime (runtime/vision/qwen_preprocess.py) gives the patches already in window order, as transformers
permutes them (get_vision_window_index), with each patch's (row, column) and window; the graph's output
rows are in that order too and the runtime puts them back:

    pixel_values    [P, 3 T p p] fp32   patch rows (window order)
    patch_positions [P, 2] int64        (row, column) of each patch in the image's patch grid
    patch_windows   [P] int64           the window each patch belongs to
      x = pixel_values @ patch_embed^T                       [P, C]   (the Conv3d as a linear)
      cos, sin = 2-D rotary: angles (row * f | column * f) twice, f = theta^(-4k/D)   [P, 1, D]
    per layer i:
        h = rmsnorm(x);  q, k, v = split(h @ qkv^T + b)        [P, H, D] each; q, k rotated (rotate-half)
        attn = softmax(q k^T / sqrt(D)) v within each window (full_layers: over all patches): the rows
               gathered into [W, S] window slots (S = (window_size / p)^2; a window cut by the image's
               edge has empty slots, masked), attended as a batch of W, gathered back (Windows); a
               lowering without data-dependent shapes (trt) adds a [P, P] window mask to all patches' scores
        x = x + attn @ o^T + b
        x = x + down(silu(gate) * up)(rmsnorm(x))              gate | up from one GEMM, with biases
    merger: rmsnorm(x) -> [P / r^2, C r^2] -> fc1 -> gelu (erf) -> fc2   image_embeds [P / r^2, hidden]

qwen3_vit differs: the patch linear has a bias and the learned position table is added, resampled to the
image's grid (pos_indices / pos_weights [P, 4]: the 4 bilinear taps the runtime computes); no windows;
LayerNorm and fc2(gelu_tanh(fc1)) blocks; LayerNorm in the merger; after each deepstack layer a merger
with its LayerNorm after the merge -> deepstack_embeds [n, P / r^2, hidden] (the text model adds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.lowering import Lowering
from decodert.models.vision import VisionSpec
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.ops.rms_norm import rms_norm_body


OPSET = 18  # ReduceMean with axes as an input (the RMSNorm body)


def qwen_contract(v: VisionSpec, dtype: str) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of the tower's inputs and outputs (also written to the manifest)."""
    inputs = [{"name": "pixel_values", "dtype": "fp32", "shape": ["patches", v.patch_features]},
              {"name": "patch_positions", "dtype": "int64", "shape": ["patches", 2]}]
    outputs = [{"name": "image_embeds", "dtype": dtype, "shape": ["image_tokens", v.out_hidden]}]
    if v.tower == "qwen3_vit":
        inputs += [{"name": "pos_indices", "dtype": "int64", "shape": ["patches", 4]},
                   {"name": "pos_weights", "dtype": "fp32", "shape": ["patches", 4]}]
        if v.deepstack:
            outputs.append({"name": "deepstack_embeds", "dtype": dtype,
                            "shape": [len(v.deepstack), "image_tokens", v.out_hidden]})
    else:
        inputs.append({"name": "patch_windows", "dtype": "int64", "shape": ["patches"]})
    return {"inputs": inputs, "outputs": outputs}


def build_qwen_vision(v: VisionSpec, dtype: str, weights: dict[str, onnx.TensorProto],
                      ir_version: int = 10, low: type[Lowering] = Lowering) -> onnx.ModelProto:
    g = GraphBuilder("decodert_vision_qwen", {"": OPSET})
    contract = qwen_contract(v, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for tensor in weights.values():
        g.add_initializer(tensor)
    np_dtype = NUMPY_DTYPES[dtype]
    qwen3 = v.tower == "qwen3_vit"
    deep: list[str] = []  # deepstack mergers' outputs
    with g.scope("vision"):
        pixels = "pixel_values" if dtype == "fp32" else g.op("Cast", "pixel_values", to=DTYPES[dtype])
        x = g.op("Gemm", pixels, "vision.patch_embed", *(["vision.patch_embed_bias"] if qwen3 else []), transB=1)
        if qwen3:
            with g.scope("pos_embed"):  # sum over the 4 taps of pos_embed[index] * weight
                w = "pos_weights" if dtype == "fp32" else g.op("Cast", "pos_weights", to=DTYPES[dtype])
                taps = g.op("Mul", g.op("Gather", "vision.pos_embed", "pos_indices", axis=0),
                            g.op("Unsqueeze", w, g.const([2])))  # [P, 4, C]
                x = g.op("Add", x, g.op("ReduceSum", taps, g.const([1]), keepdims=0))
        with g.scope("rotary"):
            cos, sin = _rotary(g, v, np_dtype)
        windows: Windows | str | None = None  # a batch of windows, or (no data-dependent shapes) a [P, P] mask
        if not qwen3 and v.window_size:
            windows = _windows(g, v, cos, sin) if low.data_dependent_shapes else _window_mask(g, np_dtype)
        for i in range(v.num_layers):
            with g.scope(f"layers.{i}"):
                x = _layer(g, v, f"vision.layers.{i}.", x, (cos, sin), None if i in v.full_layers else windows,
                           dtype, np_dtype, low)
            if i in v.deepstack:
                with g.scope(f"deepstack.{len(deep)}"):
                    deep.append(_merger(g, v, x, f"vision.deepstack.layers.{len(deep)}.", dtype, np_dtype, post=True))
        with g.scope("merger"):
            x = _merger(g, v, x, "vision.merger_", dtype, np_dtype, post=False)
    g.output(x, "image_embeds", dtype, contract["outputs"][0]["shape"])
    if deep:
        stacked = g.op("Concat", *[g.op("Unsqueeze", d, g.const([0])) for d in deep], axis=0)
        g.output(stacked, "deepstack_embeds", dtype, contract["outputs"][1]["shape"])
    return g.to_model(ir_version=ir_version)


@dataclass(frozen=True)
class Windows:
    """Window attention as a batch of windows: the patch rows gathered into [W, S] slots (S: a full window's
    patches; a window cut by the image's edge leaves slots empty), attended per window, gathered back."""

    rows: str  # [W*S] int64: the patch row each slot reads (0 for an empty slot)
    slots: str  # [P] int64: the slot each patch's output is in
    valid: str  # [W, S] bool: the slots that hold a patch
    cos: str  # [W*S, 1, D] the rotary tables in slot order
    sin: str
    size: int  # S


def _window_mask(g: GraphBuilder, np_dtype: type) -> str:
    """[P, P]: 0 within a window, a large negative across windows."""
    with g.scope("window_mask"):
        same = g.op("Equal", g.op("Unsqueeze", "patch_windows", g.const([1])),
                    g.op("Unsqueeze", "patch_windows", g.const([0])))
        low = -1e4 if np_dtype == np.float16 else -1e9
        return g.op("Where", same, g.const(np.array(0, np_dtype)), g.const(np.array(low, np_dtype)))


def _windows(g: GraphBuilder, v: VisionSpec, cos: str, sin: str) -> Windows:
    """From patch_windows [P] (the runtime gives the patches window by window, each window's in a row):
    count[w], first[w] (patches in windows before w), a patch's slot w*S + (p - first[w])."""
    size = (v.window_size // v.patch_size) ** 2
    i64 = lambda n: g.const(np.array(n, np.int64))  # noqa: E731
    with g.scope("windows"):
        win = "patch_windows"
        count_w = g.op("Squeeze", g.op("Add", g.op("ReduceMax", win, keepdims=1), g.const([1])), g.const([0]))  # W
        column = g.op("Unsqueeze", win, g.const([1]))  # [P, 1] against the window ids [W]
        ids = g.op("Range", i64(0), count_w, i64(1))
        per = lambda cmp: g.op("ReduceSum", g.op("Cast", g.op(cmp, column, ids), to=7), g.const([0]), keepdims=0)  # noqa: E731
        count, first = per("Equal"), per("Less")  # [W]: patches in window w, in windows before w
        slot = g.const(np.arange(size, dtype=np.int64))
        valid = g.op("Less", g.op("Unsqueeze", slot, g.const([0])), g.op("Unsqueeze", count, g.const([1])))  # [W, S]
        rows = g.op("Where", valid, g.op("Add", g.op("Unsqueeze", first, g.const([1])), slot), i64(0))
        rows = g.op("Reshape", rows, g.const([-1]))
        patches = g.op("Range", i64(0), g.op("Squeeze", g.op("Shape", win), g.const([0])), i64(1))
        slots = g.op("Add", g.op("Mul", win, i64(size)), g.op("Sub", patches, g.op("Gather", first, win, axis=0)))
        return Windows(rows, slots, valid, g.op("Gather", cos, rows, axis=0), g.op("Gather", sin, rows, axis=0), size)


def _merger(g: GraphBuilder, v: VisionSpec, x: str, p: str, dtype: str, np_dtype: type, post: bool) -> str:
    """[P, C] -> [P / r^2, hidden]: norm (before the merge; after it with ``post``), fc1, gelu, fc2."""
    merged = v.hidden_size * v.scale_factor ** 2
    if post:
        x = g.op("Reshape", x, g.const([-1, merged]))
    if v.tower == "qwen3_vit":
        x = g.op("LayerNormalization", x, p + "norm", p + "norm_bias", axis=-1, epsilon=1e-6)
    else:
        x = rms_norm_body(g, x, p + "norm", epsilon=1e-6, dtype=dtype)
    x = g.op("Reshape", x, g.const([-1, merged]))
    x = _gelu_erf(g, g.op("Gemm", x, p + "fc1", p + "fc1_bias", transB=1), np_dtype)
    return g.op("Gemm", x, p + "fc2", p + "fc2_bias", transB=1)


def _rotary(g: GraphBuilder, v: VisionSpec, np_dtype: type) -> tuple[str, str]:
    """cos, sin [P, 1, D] of the 2-D rotary (transformers' axial rope: rows then columns, repeated); sin with
    its first half negated, so that the rotation is x cos + swap_halves(x) sin."""
    d = v.hidden_size // v.num_heads
    quarter = np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2)
    inv = (1.0 / (v.rope_theta ** quarter)).astype(np.float32)  # [D/4]
    pos = g.op("Cast", "patch_positions", to=1)  # [P, 2] float32
    angles = g.op("Mul", g.op("Unsqueeze", pos, g.const([2])), g.const(inv.reshape(1, 1, -1)))  # [P, 2, D/4]
    half = g.op("Reshape", angles, g.const([-1, 1, d // 2]))  # rows' angles | columns' angles
    full = g.op("Concat", half, half, axis=-1)  # [P, 1, D]
    sign = np.concatenate([-np.ones(d // 2, np.float32), np.ones(d // 2, np.float32)])
    out = []
    for t in (g.op("Cos", full), g.op("Mul", g.op("Sin", full), g.const(sign))):
        out.append(t if np_dtype == np.float32 else g.op("Cast", t, to=onnx.helper.np_dtype_to_tensor_dtype(
            np.dtype(np_dtype))))
    return out[0], out[1]


def _rotate(g: GraphBuilder, x: str, cos: str, sin: str, d: int) -> str:
    """x [R, H, D] -> x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) = swap_halves(x) * (-1 | 1)."""
    x1, x2 = g.op("Split", x, g.const([d // 2, d // 2]), axis=-1, outputs=2)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", g.op("Concat", x2, x1, axis=-1), sin))


def _attention(g: GraphBuilder, v: VisionSpec, p: str, h: str, rope: tuple[str, str], windows: Windows | str | None,
               np_dtype: type, low: type[Lowering]) -> str:
    """[P, C] -> attention of every patch over its window's (``windows``: slots, or a [P, P] mask) or the
    image's patches, [P, C]."""
    c, heads = v.hidden_size, v.num_heads
    d = c // heads
    qkv = g.op("Gemm", h, p + "qkv", p + "qkv_bias", transB=1)  # [P, 3C]
    cos, sin = rope
    slots = windows if isinstance(windows, Windows) else None
    if slots is not None:  # -> [W*S, 3C] in slot order
        qkv, cos, sin = g.op("Gather", qkv, slots.rows, axis=0), slots.cos, slots.sin
    q, k, vv = g.op("Split", g.op("Reshape", qkv, g.const([-1, 3 * heads, d])), g.const([heads] * 3), axis=1,
                    outputs=3)  # [R, H, D] each
    batch = g.const([-1, slots.size, c] if slots is not None else [1, -1, c])
    q, k, vv = (g.op("Reshape", t, batch) for t in (_rotate(g, q, cos, sin, d), _rotate(g, k, cos, sin, d), vv))
    ctx = low.encoder_attention(g, q, k, vv, heads, d, np_dtype, None if slots is None else slots.valid,
                                windows if isinstance(windows, str) else None)
    ctx = g.op("Reshape", ctx, g.const([-1, c]))
    return ctx if slots is None else g.op("Gather", ctx, slots.slots, axis=0)


def _layer(g: GraphBuilder, v: VisionSpec, p: str, x: str, rope: tuple[str, str], windows: Windows | str | None,
           dtype: str, np_dtype: type, low: type[Lowering]) -> str:
    qwen3 = v.tower == "qwen3_vit"
    with g.scope("attn"):
        ctx = _attention(g, v, p, _norm(g, v, x, p, 1, dtype), rope, windows, np_dtype, low)
        x = g.op("Add", x, g.op("Gemm", ctx, p + "o", p + "o_bias", transB=1))
    with g.scope("mlp"):
        h = _norm(g, v, x, p, 2, dtype)
        if qwen3:  # fc2(gelu_tanh(fc1(h)))
            act = low.encoder_gelu_tanh(g, g.op("Gemm", h, p + "fc1", p + "fc1_bias", transB=1), np_dtype)
            return g.op("Add", x, g.op("Gemm", act, p + "fc2", p + "fc2_bias", transB=1))
        gate, up = g.op("Split", g.op("Gemm", h, p + "gate_up", p + "gate_up_bias", transB=1),
                        g.const([v.intermediate_size] * 2), axis=-1, outputs=2)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        x = g.op("Add", x, g.op("Gemm", act, p + "down", p + "down_bias", transB=1))
    return x


def _norm(g: GraphBuilder, v: VisionSpec, x: str, p: str, which: int, dtype: str) -> str:
    """The block's first or second norm: LayerNorm ln1/ln2 (qwen3_vit) or RMSNorm norm1/norm2 (qwen_vit)."""
    if v.tower == "qwen3_vit":
        return g.op("LayerNormalization", x, f"{p}ln{which}", f"{p}ln{which}_bias", axis=-1, epsilon=1e-6)
    return rms_norm_body(g, x, f"{p}norm{which}", epsilon=1e-6, dtype=dtype)


def _gelu_erf(g: GraphBuilder, x: str, np_dtype: type) -> str:
    """0.5 x (1 + erf(x / sqrt 2)): torch's nn.GELU()."""
    k = lambda value: g.const(np.array(value, np_dtype))  # noqa: E731
    return g.op("Mul", g.op("Mul", x, k(0.5)), g.op("Add", g.op("Erf", g.op("Mul", x, k(1 / math.sqrt(2)))), k(1.0)))
