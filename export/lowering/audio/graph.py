"""``audio.onnx`` by encoder kind (``BUILDERS``; the ``whisper`` kind: export/lowering/audio/whisper.py, the ``gemma4``
kind: export/lowering/audio/gemma4.py), and the
``qwen3_asr`` kind here: Qwen3-ASR's audio encoder (AuT) and projector, one clip a call, in standard ONNX ops but the
attention, the target lowering's ``encoder_attention`` (ort: MultiHeadAttention with a key mask).

The runtime (runtime/audio/encoder.py) cuts the clip's log-mel [M, T] into chunks of L = 2 n_window frames and
groups them into attention windows of r = n_window_infer / L chunks (all of them when the clip has fewer), the
last window padded with empty chunks. Every chunk but the last is full, so a window of transformers' cu_seqlens
is exactly r chunks' valid rows and the encoder runs as a batch of windows:

    input_features [N, M, L] fp32   N = windows x r chunks (empty ones zero)
    key_valid      [W, r K] bool    the rows of each window that exist (K = post_conv(L) rows a chunk)
    token_slots    [A] int64        the slot (w r K + k) of each of the clip's A audio tokens, in order
      x = gelu(conv3(gelu(conv2(gelu(conv1(features))))))        [N, D_c, F', K]  (3x3, stride 2, padding 1)
      x = [N, K, D_c F'] @ conv_out^T + sinusoids[:K]             [N, K, C]  -> [W, r K, C]
    per layer i:
        x = x + o(attention(qkv(LayerNorm(x))))                   bidirectional within a window, keys key_valid
        x = x + fc2(gelu(fc1(LayerNorm(x))))
    x = gather(x, token_slots)                                    [A, C]  the valid rows, in order
    audio_embeds = proj2(gelu(proj1(LayerNorm(x))))               [A, hidden]  in the graph dtype

Empty slots (a chunk's rows past its valid frames, the padding chunks) run through the layers and are
dropped: as keys they are masked, as queries never gathered. No data-dependent shapes: TensorRT builds it
under a profile over N, W and A.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import onnx

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.audio.gemma4 import build_conformer_graph, conformer_contract
from decodert.export.lowering.audio.encoder_layers import encoder_layer, gelu, gemm
from decodert.export.lowering.lowering import Lowering
from decodert.export.lowering.audio.whisper import build_whisper_audio, whisper_contract
from decodert.models.audio import AudioSpec
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder

OPSET = 17  # LayerNormalization


def audio_contract(a: Any, dtype: str) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of audio.onnx's inputs and output (also written to the manifest)."""
    return BUILDERS[a.encoder][0](a, dtype)


def build_audio_graph(a: Any, dtype: str, weights: dict[str, onnx.TensorProto], ir_version: int = 10,
                      low: type[Lowering] = Lowering) -> onnx.ModelProto:
    """audio.onnx of ``a``'s encoder kind over ``weights`` (canonical audio names -> external tensors in weights.bin)."""
    return BUILDERS[a.encoder][1](a, dtype, weights, ir_version, low)


def qwen3_asr_contract(a: AudioSpec, dtype: str) -> dict[str, list[dict]]:
    """The ``qwen3_asr`` encoder's inputs and output."""
    return {"inputs": [{"name": "input_features", "dtype": "fp32", "shape": ["chunks", a.num_mel_bins, a.chunk_frames]},
                       {"name": "key_valid", "dtype": "bool", "shape": ["windows", "window_slots"]},
                       {"name": "token_slots", "dtype": "int64", "shape": ["audio_tokens"]}],
            "outputs": [{"name": "audio_embeds", "dtype": dtype, "shape": ["audio_tokens", a.out_hidden]}]}


def sinusoids(length: int, channels: int) -> np.ndarray:
    """[length, channels] float32: sin | cos of t * 10000^(-k / (channels/2 - 1)) (Whisper's position table)."""
    step = np.log(10000.0) / (channels // 2 - 1)
    inv = np.exp((-step * np.arange(channels // 2, dtype=np.float32)).astype(np.float32))
    t = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def build_qwen3_asr(a: AudioSpec, dtype: str, weights: dict[str, onnx.TensorProto], ir_version: int = 10,
                    low: type[Lowering] = Lowering) -> onnx.ModelProto:
    """audio.onnx of the ``qwen3_asr`` encoder."""
    g = GraphBuilder("decodert_audio", {"": OPSET})
    contract = qwen3_asr_contract(a, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for tensor in weights.values():
        g.add_initializer(tensor)
    np_dtype = NUMPY_DTYPES[dtype]
    c, k = a.hidden_size, a.chunk_tokens
    with g.scope("audio"):
        with g.scope("conv"):
            x = "input_features" if dtype == "fp32" else g.op("Cast", "input_features", to=DTYPES[dtype])
            x = g.op("Unsqueeze", x, g.const([1]))  # [N, 1, M, L]
            for j in (1, 2, 3):
                x = gelu(g, g.op("Conv", x, f"audio.conv{j}", f"audio.conv{j}_bias", kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1, 1, 1, 1]), np_dtype)  # [N, D_c, F, K]
            x = g.op("Transpose", x, perm=[0, 3, 1, 2])  # [N, K, D_c, F']
            x = g.op("Gemm", g.op("Reshape", x, g.const([-1, a.conv_channels * a.mel_out])), "audio.conv_out",
                     transB=1)  # [N K, C]
            x = g.op("Add", g.op("Reshape", x, g.const([-1, k, c])),
                     g.const(sinusoids(a.max_positions, c)[:k].astype(np_dtype)))  # [N, K, C]
            x = g.op("Reshape", x, g.const([-1, c]))  # [W r K, C]: window w's slots are rows w r K ..
        batch = g.op("Concat", g.op("Shape", "key_valid"), g.const([c]), axis=0)  # [W, r K, C]
        for i in range(a.num_layers):
            with g.scope(f"layers.{i}"):
                x = _layer(g, a, f"audio.layers.{i}.", x, batch, np_dtype, low)
        with g.scope("out"):
            x = g.op("Gather", x, "token_slots", axis=0)  # [A, C]
            x = g.op("LayerNormalization", x, "audio.ln_post", "audio.ln_post_bias", axis=-1, epsilon=a.layer_norm_eps)
            x = gelu(g, g.op("Gemm", x, "audio.proj1", "audio.proj1_bias", transB=1), np_dtype)
            x = g.op("Gemm", x, "audio.proj2", "audio.proj2_bias", transB=1)
    g.output(x, "audio_embeds", dtype, contract["outputs"][0]["shape"])
    return g.to_model(ir_version=ir_version)


def _layer(g: GraphBuilder, a: AudioSpec, p: str, x: str, batch: str, np_dtype: type, low: type[Lowering]) -> str:
    """One pre-norm encoder layer over the [W r K, C] slot rows (q|k|v one fused Gemm)."""
    c, heads = a.hidden_size, a.num_heads

    def qkv(h: str) -> tuple[str, str, str]:
        fused = g.op("Gemm", h, p + "qkv", p + "qkv_bias", transB=1)  # [R, 3C]
        return tuple(g.op("Reshape", t, batch) for t in g.op("Split", fused, g.const([c] * 3), axis=-1, outputs=3))

    def attend(q: str, k: str, v: str) -> str:
        ctx = low.encoder_attention(g, q, k, v, heads, c // heads, np_dtype, "key_valid")  # [W, r K, C]
        return g.op("Reshape", ctx, g.const([-1, c]))

    return encoder_layer(g, x, p, a.layer_norm_eps, gemm(g), qkv, attend, np_dtype)


# encoder kind (models/audio.py KINDS) -> (contract, builder); each kind's graph in its own function or module
BUILDERS: dict[str, tuple[Callable[..., dict], Callable[..., onnx.ModelProto]]] = {
    "qwen3_asr": (qwen3_asr_contract, build_qwen3_asr),
    "whisper": (whisper_contract, build_whisper_audio),
    "gemma4": (conformer_contract, build_conformer_graph),
}
