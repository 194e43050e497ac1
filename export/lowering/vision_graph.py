"""``vision.onnx``: a SigLIP-style tower, the pixel shuffle and the projector, in standard ONNX ops but the
attention, the target lowering's ``encoder_attention`` (ort: MultiHeadAttention; portable / trt: standard ops;
TensorRT builds it under its own profile).

    pixel_values [N, 3, S, S] fp32 (N tiles, already resized, rescaled and normalised)
      --Conv(patch_embed, stride P)--> [N, C, S/P, S/P] -> [N*T, C]  (T = (S/P)^2 patches)   + pos_embed
    per layer i:
        h = LayerNorm(x);  q | k | v = h @ qkv^T + b    [N, T, C] each
        attn = softmax(q k^T / sqrt(D)) v         per head, bidirectional over one tile's patches
        x = x + attn @ o^T + b
        x = x + fc2(gelu_tanh(fc1(LayerNorm(x))))
    x = LayerNorm(x)                                [N, T, C]
    connector "pixel_shuffle" (Idefics3): r*r neighbouring patches -> [N, T/r^2, C*r^2] (Idefics3Connector order)
    connector "avg_pool" (Gemma 3): r x r average pooling of the patch grid [N, T/r^2, C], then
              RMSNorm in float32 times proj_norm (the (1 + w) factor)   (Gemma3MultiModalProjector)
    image_embeds = x @ proj^T                       [N, T/r^2, hidden]  in the graph dtype
"""

from __future__ import annotations

import numpy as np
import onnx

from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.lowering import Lowering
from decodert.export.lowering.vision_qwen import build_qwen_vision, qwen_contract
from decodert.models.vision import VisionSpec

OPSET = 17  # LayerNormalization


def vision_contract(v: VisionSpec, dtype: str) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of vision.onnx's input and output (also written to the manifest)."""
    if v.tower in ("qwen_vit", "qwen3_vit"):
        return qwen_contract(v, dtype)
    return {"inputs": [{"name": "pixel_values", "dtype": "fp32", "shape": ["images", 3, v.image_size, v.image_size]}],
            "outputs": [{"name": "image_embeds", "dtype": dtype, "shape": ["images", v.tokens_per_tile, v.out_hidden]}]}


def build_vision_graph(v: VisionSpec, dtype: str, weights: dict[str, onnx.TensorProto],
                       ir_version: int = 10, low: type[Lowering] = Lowering) -> onnx.ModelProto:
    """vision.onnx over ``weights`` (canonical vision names -> external tensors in weights.bin); ``low``: the
    target's lowering (its ``encoder_attention``; the base class: standard ops only)."""
    if v.tower in ("qwen_vit", "qwen3_vit"):  # Qwen2.5-VL's / Qwen3-VL's ViT: export/lowering/vision_qwen.py
        return build_qwen_vision(v, dtype, weights, ir_version, low)
    g = GraphBuilder("decodert_vision", {"": OPSET})
    contract = vision_contract(v, dtype)
    g.input("pixel_values", "fp32", contract["inputs"][0]["shape"])
    for tensor in weights.values():
        g.add_initializer(tensor)
    np_dtype = NUMPY_DTYPES[dtype]
    c, t = v.hidden_size, v.patches_per_side ** 2
    with g.scope("vision"):
        with g.scope("patches"):
            pixels = "pixel_values" if dtype == "fp32" else g.op("Cast", "pixel_values", to=onnx.TensorProto.FLOAT16
                                                                 if dtype == "fp16" else onnx.TensorProto.BFLOAT16)
            x = g.op("Conv", pixels, "vision.patch_embed", "vision.patch_embed_bias",
                     kernel_shape=[v.patch_size] * 2, strides=[v.patch_size] * 2)  # [N, C, S/P, S/P]
            x = g.op("Transpose", g.op("Reshape", x, g.const([0, c, t])), perm=[0, 2, 1])  # [N, T, C]
            x = g.op("Reshape", g.op("Add", x, "vision.pos_embed"), g.const([-1, c]))  # [N*T, C]
        for i in range(v.num_layers):
            with g.scope(f"layers.{i}"):
                x = _layer(g, v, f"vision.layers.{i}.", x, np_dtype, low)
        with g.scope("post_ln"):
            x = _layer_norm(g, v, x, "vision.post_ln")
        with g.scope(v.connector):
            x = _pixel_shuffle(g, v, x) if v.connector == "pixel_shuffle" else _avg_pool(g, v, x, dtype)
        with g.scope("proj"):
            x = g.op("Gemm", x, "vision.proj", transB=1)
            x = g.op("Reshape", x, g.const([-1, v.tokens_per_tile, v.out_hidden]))
    g.output(x, "image_embeds", dtype, contract["outputs"][0]["shape"])
    return g.to_model(ir_version=ir_version)


def _layer_norm(g: GraphBuilder, v: VisionSpec, x: str, name: str) -> str:
    return g.op("LayerNormalization", x, name, name + "_bias", axis=-1, epsilon=v.layer_norm_eps)


def _linear(g: GraphBuilder, x: str, name: str) -> str:
    return g.op("Gemm", x, name, name + "_bias", transB=1)


def _layer(g: GraphBuilder, v: VisionSpec, p: str, x: str, np_dtype: type, low: type[Lowering]) -> str:
    """One pre-norm encoder layer over [N*T, C] rows."""
    c, heads = v.hidden_size, v.num_heads
    t = v.patches_per_side ** 2
    with g.scope("attn"):
        qkv = _linear(g, _layer_norm(g, v, x, p + "ln1"), p + "qkv")  # [N*T, 3C]
        q, k, vv = g.op("Split", g.op("Reshape", qkv, g.const([-1, t, 3 * c])), g.const([c] * 3), axis=-1,
                        outputs=3)  # each [N, T, C]
        ctx = low.encoder_attention(g, q, k, vv, heads, c // heads, np_dtype)  # [N, T, C], one tile per row
        x = g.op("Add", x, _linear(g, g.op("Reshape", ctx, g.const([-1, c])), p + "o"))
    with g.scope("mlp"):
        h = _linear(g, _layer_norm(g, v, x, p + "ln2"), p + "fc1")
        x = g.op("Add", x, _linear(g, low.encoder_gelu_tanh(g, h, np_dtype), p + "fc2"))
    return x


def _pixel_shuffle(g: GraphBuilder, v: VisionSpec, x: str) -> str:
    """[N*T, C] -> [N*T/r^2, C*r^2] in transformers' order (Idefics3Connector.pixel_shuffle)."""
    side, c, r = v.patches_per_side, v.hidden_size, v.scale_factor
    x = g.op("Reshape", x, g.const([-1, side, side // r, c * r]))  # [N, h, w/r, C r]
    x = g.op("Transpose", x, perm=[0, 2, 1, 3])  # [N, w/r, h, C r]
    x = g.op("Reshape", x, g.const([-1, side // r, side // r, c * r * r]))  # [N, w/r, h/r, C r^2]
    x = g.op("Transpose", x, perm=[0, 2, 1, 3])
    return g.op("Reshape", x, g.const([-1, c * r * r]))


def _avg_pool(g: GraphBuilder, v: VisionSpec, x: str, dtype: str) -> str:
    """[N*T, C] -> r x r average pooling of each tile's patch grid, RMS-normed -> [N*T/r^2, C]
    (Gemma3MultiModalProjector: pooled rows in row-major order, the norm in float32)."""
    side, c, r = v.patches_per_side, v.hidden_size, v.scale_factor
    x = g.op("Transpose", g.op("Reshape", x, g.const([-1, side, side, c])), perm=[0, 3, 1, 2])  # [N, C, side, side]
    x = g.op("AveragePool", x, kernel_shape=[r, r], strides=[r, r])  # [N, C, side/r, side/r]
    x = g.op("Reshape", g.op("Transpose", g.op("Reshape", x, g.const([0, c, -1])), perm=[0, 2, 1]), g.const([-1, c]))
    xf = x if dtype == "fp32" else g.op("Cast", x, to=onnx.TensorProto.FLOAT)
    mean = g.op("ReduceMean", g.op("Mul", xf, xf), axes=[-1], keepdims=1)
    xf = g.op("Div", xf, g.op("Sqrt", g.op("Add", mean, g.const(np.array(v.layer_norm_eps, np.float32)))))
    weight = "vision.proj_norm" if dtype == "fp32" else g.op("Cast", "vision.proj_norm", to=onnx.TensorProto.FLOAT)
    xf = g.op("Mul", xf, weight)
    return xf if dtype == "fp32" else g.op("Cast", xf, to=DTYPES[dtype])
