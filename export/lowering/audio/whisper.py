"""``audio.onnx`` of the ``whisper`` encoder kind (Qwen2-Audio): Whisper's encoder over the first rows of one 30 s
log-mel window, average-pooled by 2, LayerNorm, the projector. The layers are Whisper's (export/lowering/
audio/encoder_layers.py), the attention the target lowering's ``encoder_attention`` with a key mask.

transformers always runs 3000 frames (1500 rows) and masks the keys past the clip's rows n = (l - 1) // 2 + 1
(l the valid frames); a pooled token j < n // 2 reads rows 2j, 2j + 1 < n only, and a valid row reads mel frames
up to 2n (conv2 stride 2 over conv1's rows, kernel 3). So the runtime (runtime/audio/encoder.py) feeds only the
first F = 2R frames of the 30 s window, R >= n + 1 rows (even, at most 1500): every valid row sees the frames it
sees in transformers (the padding frames past the clip are the extractor's, not zeros), and a short clip costs
its own length, not 30 s:

    input_features [B, M, F] fp32     the window's first F log-mel frames
    key_valid      [B, R] bool        the rows that exist (n of them)
    token_slots    [A] int64          the pooled rows kept, b R/2 + j for j < n // 2, in order
      x = gelu(conv2(gelu(conv1(features))))                  [B, C, R]  (kernel 3, padding 1; conv2 stride 2)
      x = x^T + positions[:R]                                 [B, R, C]
      per layer i: x += o(attention(q, k, v of LayerNorm(x)));  x += fc2(gelu(fc1(LayerNorm(x))))
      x = mean of row pairs (2j, 2j + 1)                      [B R/2, C]  (AvgPool1d(2, stride 2))
      x = gather(x, token_slots)                              [A, C]
      audio_embeds = LayerNorm(x) @ proj^T + proj_bias        [A, hidden]  in the graph dtype
"""

from __future__ import annotations

import onnx

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.audio.encoder_layers import encoder_layer, gelu, gemm, layer_norm, separate_qkv
from decodert.export.lowering.lowering import Lowering
from decodert.models.audio import AudioSpec
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder

OPSET = 17  # LayerNormalization


def whisper_contract(a: AudioSpec, dtype: str) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of the graph's inputs and output (also written to the manifest)."""
    return {"inputs": [{"name": "input_features", "dtype": "fp32", "shape": ["clips", a.num_mel_bins, "frames"]},
                       {"name": "key_valid", "dtype": "bool", "shape": ["clips", "rows"]},
                       {"name": "token_slots", "dtype": "int64", "shape": ["audio_tokens"]}],
            "outputs": [{"name": "audio_embeds", "dtype": dtype, "shape": ["audio_tokens", a.out_hidden]}]}


def build_whisper_audio(a: AudioSpec, dtype: str, weights: dict[str, onnx.TensorProto], ir_version: int = 10,
                        low: type[Lowering] = Lowering) -> onnx.ModelProto:
    """audio.onnx of a ``whisper`` encoder over ``weights`` (canonical audio names, weights stored [out, in])."""
    g = GraphBuilder("decodert_audio", {"": OPSET})
    contract = whisper_contract(a, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for tensor in weights.values():
        g.add_initializer(tensor)
    np_dtype = NUMPY_DTYPES[dtype]
    c, heads, eps = a.hidden_size, a.num_heads, a.layer_norm_eps
    linear = gemm(g)
    with g.scope("audio"):
        with g.scope("conv"):
            x = "input_features" if dtype == "fp32" else g.op("Cast", "input_features", to=DTYPES[dtype])
            x = gelu(g, g.op("Conv", x, "audio.conv1", "audio.conv1_bias", kernel_shape=[3], pads=[1, 1]), np_dtype)
            x = gelu(g, g.op("Conv", x, "audio.conv2", "audio.conv2_bias", kernel_shape=[3], strides=[2], pads=[1, 1]),
                     np_dtype)  # [B, C, R]
            rows = g.op("Shape", "key_valid", start=1, end=2)  # [1] R
            positions = g.op("Slice", "audio.positions", g.const([0]), rows, g.const([0]))  # [R, C]
            x = g.op("Add", g.op("Transpose", x, perm=[0, 2, 1]), positions)  # [B, R, C]
            x = g.op("Reshape", x, g.const([-1, c]))  # [B R, C]
        batch = g.op("Concat", g.op("Shape", "key_valid"), g.const([c]), axis=0)  # [B, R, C]

        def attend(q: str, k: str, v: str) -> str:
            q, k, v = (g.op("Reshape", t, batch) for t in (q, k, v))
            ctx = low.encoder_attention(g, q, k, v, heads, c // heads, np_dtype, "key_valid")  # [B, R, C]
            return g.op("Reshape", ctx, g.const([-1, c]))

        for i in range(a.num_layers):
            p = f"audio.layers.{i}."
            with g.scope(f"layers.{i}"):
                x = encoder_layer(g, x, p, eps, linear, separate_qkv(linear, p), attend, np_dtype)
        with g.scope("out"):
            pairs = g.op("Reshape", x, g.const([-1, 2, c]))  # [B R/2, 2, C]: rows 2j, 2j + 1 of each clip
            x = g.op("ReduceMean", pairs, axes=[1], keepdims=0)  # [B R/2, C]
            x = g.op("Gather", x, "token_slots", axis=0)  # [A, C]
            x = linear(layer_norm(g, x, "audio.ln_post", eps), "audio.proj", "audio.proj_bias")
    g.output(x, "audio_embeds", dtype, contract["outputs"][0]["shape"])
    return g.to_model(ir_version=ir_version)
