"""``audio.onnx`` of the ``gemma4`` encoder kind: Gemma 4's conformer (transformers' Gemma4AudioModel) and the
embedder into the text model (Gemma4MultimodalEmbedder), one clip a call, in standard ONNX ops only (both the ort
and the trt target build it; opset 17).

The runtime (runtime/audio/conformer.py) pads the clip's log-mel frames to a multiple of 4 C, so that the rows after
the two halvings are N whole blocks of C = chunk rows, and computes the masks:

    input_features [F, M] fp32      F = 4 N C frames, the invalid ones zero (the extractor zeroes them too)
    sub_valid      [F/2] bool       the first convolution's rows that exist (its frame mask read every 2nd frame)
    key_valid      [N, C, X] bool   key x of block n visible to query c: the key exists (its row in the mask halved
                                    twice) and lies in transformers' window (0 <= q - k < context_left - 1, or
                                    0 < k - q < context_right); X = C + context_left - 1 + context_right keys,
                                    block n's from row n C - (context_left - 1)
    token_slots    [A] int64        the rows that exist (A = the clip's audio tokens)
      h = relu(LN(conv0(features)))            [F/2, M/2, c0]   3x3 stride 2 padding 1, LayerNorm over channels
      h = h * sub_valid;  h = relu(LN(conv1(h)))  [N C, M', c1]
      x = [N C, M' c1] @ sub.proj^T                [N C, H]
    per layer (clamp: +-gradient_clipping; rms: x / sqrt(mean x^2 + eps) * w; clip_linear: the bounds clamp the
    input and the output of a bias-free linear):
      x = x + 0.5 rms(ff2(silu(ff1(rms(clamp x)))))                        (feed_forward1; 0.5 = residual_weight)
      x = x + rms(clamp(o(attention(rms(clamp x)))))                       chunked local attention, below
      x = x + end(silu(rms(clamp(depthwise_causal(glu(start(rms x)))))))   the light conv (kernel K, left-padded)
      x = x + 0.5 rms(...)                                                 (feed_forward2)
      x = rms(clamp x)
    attention, per head (D = H / heads):
      q = q(h) / sqrt(D) / ln 2 * softplus(per_dim_scale)      [N, C, D]  the blocks of C queries
      k = k(h) ln(1 + e) / ln 2, v = v(h): each block's X keys (rows padded by context_left - 1 before, context_right
          after, gathered)                                   [N, X, D]
      r = rel_k(sinusoids(X // 2 + 1 distances, X // 2 .. 0))  [P, D]
      logits = q k^T + shift(q r^T)                            [N, C, X]  shift: Transformer-XL's relative shift
                                                                         (pad to X + 1, flatten, cut, refold)
      logits = where(key_valid, cap tanh(logits / cap), -1e9);  out = softmax(logits) v
    x = gather(x, token_slots)                     [A, H]
    audio_embeds = rms_noscale(out_proj(x)) @ embed_proj^T   [A, hidden] in the graph dtype

No data-dependent shapes: N, F and A come from the inputs' shapes (TensorRT builds it under a profile).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from decodert.artifact.weights import NUMPY_DTYPES
from decodert.export.lowering.lowering import DTYPE_OF, Lowering
from decodert.models.audio_conformer import ConformerSpec, clipped
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder

OPSET = 17  # LayerNormalization
NORM_EPS = 1e-6  # Gemma4RMSNorm's default: the feed-forward, attention and output norms of a layer


def conformer_contract(a: ConformerSpec, dtype: str) -> dict[str, list[dict]]:
    """Names, dtypes and shapes of audio.onnx's inputs and output (also written to the manifest)."""
    return {"inputs": [{"name": "input_features", "dtype": "fp32", "shape": ["frames", a.num_mel_bins]},
                       {"name": "sub_valid", "dtype": "bool", "shape": ["sub_frames"]},
                       {"name": "key_valid", "dtype": "bool", "shape": ["blocks", a.chunk, a.context]},
                       {"name": "token_slots", "dtype": "int64", "shape": ["audio_tokens"]}],
            "outputs": [{"name": "audio_embeds", "dtype": dtype, "shape": ["audio_tokens", a.out_hidden]}]}


def relative_positions(a: ConformerSpec) -> np.ndarray:
    """[P, H] float32: sin | cos of distance d x 10000^(-k / (H/2 - 1)) for d = X // 2 .. 0
    (Gemma4AudioRelPositionalEncoding)."""
    n = a.hidden_size // 2
    inv = np.exp(np.arange(n, dtype=np.float32) * np.float32(-math.log(10000.0) / max(n - 1, 1)))
    t = np.arange(a.positions - 1, -1, -1, dtype=np.float32)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


class _Ops:
    """The conformer's building blocks over [R, C] rows in the graph dtype."""

    def __init__(self, g: GraphBuilder, a: ConformerSpec, np_dtype: type) -> None:
        self.g, self.a, self.dt = g, a, np_dtype
        self.clips = clipped(a)
        big = min(a.gradient_clipping, float(np.finfo(np_dtype).max))
        self.lo, self.hi = self.k(-big), self.k(big)

    def k(self, value: float) -> str:
        return self.g.const(np.array(value, self.dt))

    def clamp(self, x: str) -> str:
        return self.g.op("Min", self.g.op("Max", x, self.lo), self.hi)

    def rms(self, x: str, weight: str | None, eps: float) -> str:
        g = self.g
        ms = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
        y = g.op("Mul", x, g.op("Pow", g.op("Add", ms, self.k(eps)), self.k(-0.5)))
        return y if weight is None else g.op("Mul", y, weight)

    def linear(self, x: str, name: str) -> str:
        """A clipped linear (Gemma4ClippableLinear), or a plain one where the spec clips none."""
        g, leaf = self.g, name.split(".", 3)[-1]
        if leaf not in self.clips:
            return g.op("Gemm", x, name, transB=1)
        def bound(j: int) -> str:  # a scalar: the bounds are stored float32 (models/audio.py audio_dtype)
            b = g.op("Gather", name + "_clip", g.const(np.int64(j)), axis=0)
            return b if self.dt == np.float32 else g.op("Cast", b, to=DTYPES[DTYPE_OF[np.dtype(self.dt)]])

        x = g.op("Min", g.op("Max", x, bound(0)), bound(1))
        y = g.op("Gemm", x, name, transB=1)
        return g.op("Min", g.op("Max", y, bound(2)), bound(3))

    def silu(self, x: str) -> str:
        return self.g.op("Mul", x, self.g.op("Sigmoid", x))


def build_conformer_graph(a: ConformerSpec, dtype: str, weights: dict[str, onnx.TensorProto], ir_version: int = 10,
                          low: type[Lowering] = Lowering) -> onnx.ModelProto:
    """audio.onnx over ``weights`` (canonical audio names -> external tensors in weights.bin); ``low`` is not read:
    every op is a standard one."""
    g = GraphBuilder("decodert_audio", {"": OPSET})
    contract = conformer_contract(a, dtype)
    for io in contract["inputs"]:
        g.input(io["name"], io["dtype"], io["shape"])
    for tensor in weights.values():
        g.add_initializer(tensor)
    np_dtype = NUMPY_DTYPES[dtype]
    ops = _Ops(g, a, np_dtype)
    with g.scope("audio"):
        with g.scope("subsample"):
            x = _subsample(g, a, ops, dtype)  # [N C, H]
        for i in range(a.num_layers):
            with g.scope(f"layers.{i}"):
                x = _layer(g, a, ops, f"audio.layers.{i}.", x)
        with g.scope("out"):
            x = g.op("Gather", x, "token_slots", axis=0)  # [A, H]
            x = g.op("Gemm", x, "audio.out_proj", "audio.out_proj_bias", transB=1)  # [A, O]
            x = g.op("Gemm", ops.rms(x, None, a.rms_norm_eps), "audio.embed_proj", transB=1)  # [A, hidden]
    g.output(x, "audio_embeds", dtype, contract["outputs"][0]["shape"])
    return g.to_model(ir_version=ir_version)


def _subsample(g: GraphBuilder, a: ConformerSpec, ops: _Ops, dtype: str) -> str:
    """Two stride-2 convolutions, each with a LayerNorm over its channels and a ReLU -> the [N C, H] rows."""
    x = "input_features" if dtype == "fp32" else g.op("Cast", "input_features", to=DTYPES[dtype])
    x = g.op("Unsqueeze", x, g.const([0, 1]))  # [1, 1, F, M]
    for j in (0, 1):
        x = g.op("Conv", x, f"audio.sub.conv{j}", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])  # [1, c, T, m]
        x = g.op("Transpose", x, perm=[0, 2, 3, 1])  # [1, T, m, c]
        x = g.op("Relu", g.op("LayerNormalization", x, f"audio.sub.norm{j}", axis=-1, epsilon=a.rms_norm_eps))
        if j == 0:  # the rows the frame mask halved keeps; the next convolution reads zeros elsewhere
            valid = g.op("Cast", g.op("Reshape", "sub_valid", g.const([1, -1, 1, 1])), to=DTYPES[dtype])
            x = g.op("Transpose", g.op("Mul", x, valid), perm=[0, 3, 1, 2])  # [1, c0, F/2, M/2]
    x = g.op("Reshape", x, g.const([-1, a.mel_out * a.conv_channels[1]]))  # [N C, M' c1]: (mel, channel) flattened
    return g.op("Gemm", x, "audio.sub.proj", transB=1)  # [N C, H]


def _feed_forward(g: GraphBuilder, a: ConformerSpec, ops: _Ops, p: str, x: str) -> str:
    h = ops.rms(ops.clamp(x), p + "pre_norm", NORM_EPS)
    h = ops.linear(ops.silu(ops.linear(h, p + "fc1")), p + "fc2")
    h = ops.rms(ops.clamp(h), p + "post_norm", NORM_EPS)
    return g.op("Add", x, g.op("Mul", h, ops.k(a.residual_weight)))


def _layer(g: GraphBuilder, a: ConformerSpec, ops: _Ops, p: str, x: str) -> str:
    """One conformer layer over the [N C, H] rows."""
    with g.scope("ff1"):
        x = _feed_forward(g, a, ops, p + "ff1.", x)
    with g.scope("attn"):
        h = _attention(g, a, ops, p + "attn.", ops.rms(ops.clamp(x), p + "attn.pre_norm", NORM_EPS))
        x = g.op("Add", x, ops.rms(ops.clamp(h), p + "attn.post_norm", NORM_EPS))
    with g.scope("conv"):
        h = ops.linear(ops.rms(x, p + "conv.pre_norm", a.rms_norm_eps), p + "conv.start")  # [R, 2H]
        half, gate = g.op("Split", h, g.const([a.hidden_size] * 2), axis=-1, outputs=2)
        h = g.op("Mul", half, g.op("Sigmoid", gate))  # GLU
        h = g.op("Unsqueeze", g.op("Transpose", h, perm=[1, 0]), g.const([0]))  # [1, H, R]
        h = g.op("Pad", h, g.const([0, 0, a.conv_kernel - 1, 0, 0, 0]))  # causal: K - 1 zeros before
        h = g.op("Conv", h, p + "conv.depthwise", kernel_shape=[a.conv_kernel], group=a.hidden_size)  # [1, H, R]
        h = g.op("Transpose", g.op("Squeeze", h, g.const([0])), perm=[1, 0])  # [R, H]
        h = ops.silu(ops.rms(ops.clamp(h), p + "conv.norm", a.rms_norm_eps))
        x = g.op("Add", x, ops.linear(h, p + "conv.end"))
    with g.scope("ff2"):
        x = _feed_forward(g, a, ops, p + "ff2.", x)
    return ops.rms(ops.clamp(x), p + "out_norm", NORM_EPS)


def _attention(g: GraphBuilder, a: ConformerSpec, ops: _Ops, p: str, h: str) -> str:
    """Chunked local attention with the relative position bias over [N C, H] rows -> [N C, H] (after ``o``)."""
    heads, d, c, ctx, dt = a.num_heads, a.head_dim, a.chunk, a.context, ops.dt
    q = g.op("Mul", g.op("Mul", ops.linear(h, p + "q"), ops.k(d ** -0.5 / math.log(2))), g.op("Tile", g.op(
        "Softplus", p + "per_dim_scale"), g.const([heads])))  # [R, H]
    k = g.op("Mul", ops.linear(h, p + "k"), ops.k(math.log(1 + math.e) / math.log(2)))
    v = ops.linear(h, p + "v")
    q = g.op("Transpose", g.op("Reshape", q, g.const([-1, c, heads, d])), perm=[2, 0, 1, 3])  # [heads, N, C, D]
    blocks = g.op("Slice", g.op("Shape", "key_valid"), g.const([0]), g.const([1]))  # [1] = N
    n = g.op("Squeeze", blocks, g.const([0]))
    one = g.const(np.int64(1))
    rows = g.op("Mul", g.op("Unsqueeze", g.op("Range", g.const(np.int64(0)), n, one), g.const([1])), g.const(np.int64(c)))
    index = g.op("Add", rows, g.const(np.arange(ctx, dtype=np.int64)[None, :]))  # [N, X]: padded row n C + x

    def windows(t: str) -> str:  # [R, H] -> each block's X keys [N, X, heads, D]
        t = g.op("Pad", t, g.const([a.past, 0, a.context_right, 0]))  # [R + past + right, H]
        return g.op("Reshape", g.op("Gather", t, index, axis=0), g.const([-1, ctx, heads, d]))

    kw = g.op("Transpose", windows(k), perm=[2, 0, 3, 1])  # [heads, N, D, X]
    vw = g.op("Transpose", windows(v), perm=[2, 0, 1, 3])  # [heads, N, X, D]
    ac = g.op("MatMul", q, kw)  # [heads, N, C, X]
    rel = g.op("Gemm", g.const(relative_positions(a).astype(dt)), p + "rel_k", transB=1)  # [P, H]
    rel = g.op("Transpose", g.op("Reshape", rel, g.const([a.positions, heads, 1, d])), perm=[1, 2, 3, 0])  # [heads,1,D,P]
    bd = g.op("MatMul", q, rel)  # [heads, N, C, P]
    bd = g.op("Pad", bd, g.const([0, 0, 0, 0, 0, 0, 0, ctx + 1 - a.positions]))  # [heads, N, C, X + 1]
    bd = g.op("Reshape", bd, g.const([heads, -1, c * (ctx + 1)]))
    bd = g.op("Slice", bd, g.const([0]), g.const([c * ctx]), g.const([2]))
    bd = g.op("Reshape", bd, g.const([heads, -1, c, ctx]))  # [heads, N, C, X]: bias of distance q - k
    logits = g.op("Add", ac, bd)
    cap = ops.k(a.logit_cap)
    logits = g.op("Mul", g.op("Tanh", g.op("Div", logits, cap)), cap)
    fill = ops.k(max(a.invalid_logit, float(np.finfo(dt).min)))
    logits = g.op("Where", g.op("Unsqueeze", "key_valid", g.const([0])), logits, fill)
    out = g.op("MatMul", g.op("Softmax", logits, axis=-1), vw)  # [heads, N, C, D]
    out = g.op("Reshape", g.op("Transpose", out, perm=[1, 2, 0, 3]), g.const([-1, a.hidden_size]))  # [N C, H]
    return ops.linear(out, p + "o")
