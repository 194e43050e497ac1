"""The pieces every head graph with a K/V of its own shares (qwen3_5_mtp.py, eagle3.py): one call runs S pairs per
row at positions M..M+S-1 over the head's cache of earlier positions, which the runtime's ``HeadCache``
(runtime/speculation/mtp.py) owns and writes from the call's ``new_key.0`` / ``new_value.0``.

    past_lengths [B] int64   M: the position of the row's first pair (the head's entries it reads end there)
    past_starts  [B] int64   the first position the head holds an entry for (keys before it are not read)
    seq_lengths  [B] int64   pairs of the row that are real (the rest pad the batch)
    past_key.0 / past_value.0 [B, H_kv, P, D]   the head's cache, positions 0..P-1 (P >= max M; read only)

A key j < P is visible to a query of the row iff start <= j < M; a key fed with the call (position M+s') iff s' <= s.
Attention, norms and residuals run in float32; the linear weights are stored in the head's dtype, or block-quantized
(``quant``: com.microsoft.MatMulNBits, the ort target's layout, export/quantize/weight_layouts.py) where asked.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto, numpy_helper

from decodert.export.quantize.quant import QuantConfig, WeightQuant, quantize
from decodert.export.quantize.weight_layouts import NBITS
from decodert.models.rope import RopeSpec
from decodert.plugins.onnx_builder import GraphBuilder

NP = {"fp32": np.float32, "fp16": np.float16}
ONNX_FLOAT = {"fp32": 1, "fp16": 10}
CACHE = ("key", "value")


def cache_inputs(dtype: str, kv: int, d: int) -> list[dict]:
    """The position and cache inputs above, after the head's own (the head manifest's ``graph``)."""
    ios = [{"name": n, "dtype": "int64", "shape": ["batch"]} for n in ("past_lengths", "past_starts", "seq_lengths")]
    return ios + [{"name": f"past_{n}.0", "dtype": dtype, "shape": ["batch", kv, "past", d]} for n in CACHE]


def cache_outputs(dtype: str, kv: int, d: int) -> list[dict]:
    return [{"name": f"new_{n}.0", "dtype": dtype, "shape": ["batch", kv, "seq", d]} for n in CACHE]


def add_weights(g: GraphBuilder, weights: dict[str, np.ndarray], dtype: str,
                quant: QuantConfig | None = None, quantized: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
    """Norms (``*norm``) in float32, ``experts.*`` as they are, integer tables as they are, the linears named in
    ``quantized`` block-quantized by ``quant`` (``name.q`` / ``.scales`` / ``.zero_points`` as MatMulNBits reads
    them), every other weight a linear [out, in] stored transposed for MatMul in the head's dtype. Returns the
    quantized ones' [out, in]."""
    shapes = {}
    for name, w in weights.items():
        if quant is not None and name in quantized:
            qw = quantize(np.asarray(w, np.float32), quant)
            NBITS.write(_Initializers(g), name, qw, WeightQuant(quant.bits, quant.block_size, quant.symmetric, "rtn"), dtype)
            shapes[name] = (qw.n, qw.k)
        elif name.endswith("norm"):
            g.add_initializer(numpy_helper.from_array(w.astype(np.float32).reshape(-1), name))
        elif name.startswith("experts."):  # [E, rows, in] as plugins/ops/moe.py takes them
            g.add_initializer(numpy_helper.from_array(w.astype(NP[dtype]), name))
        elif np.issubdtype(w.dtype, np.integer):
            g.add_initializer(numpy_helper.from_array(w, name))
        else:
            g.add_initializer(numpy_helper.from_array(np.ascontiguousarray(w.T).astype(NP[dtype]), name))
    return shapes


class _Initializers:
    """The writer export/quantize/weight_layouts.py writes a layout through (artifact/weights.py's ``add`` /
    ``add_raw``), onto a graph's initializers: a head's weights live in head.bin beside its graph."""

    def __init__(self, g: GraphBuilder) -> None:
        self.g = g

    def add(self, name: str, array: np.ndarray, dtype: str) -> None:
        self.g.add_initializer(numpy_helper.from_array(np.ascontiguousarray(array.astype(NP[dtype])), name))

    def add_raw(self, name: str, data: np.ndarray, data_type: int, dims: tuple[int, ...]) -> None:
        tensor = numpy_helper.from_array(np.ascontiguousarray(data).reshape(dims), name)
        if tensor.data_type != data_type:
            raise ValueError(f"{name}: {TensorProto.DataType.Name(tensor.data_type)}, the layout declares "
                             f"{TensorProto.DataType.Name(data_type)}")
        self.g.add_initializer(tensor)


@dataclasses.dataclass
class HeadOps:
    """Float32 building blocks over a graph whose linear weights are stored in ``dtype``."""

    g: GraphBuilder
    dtype: str
    eps: float
    quant: QuantConfig | None = None
    quantized: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name -> [out, in] (add_weights)

    def norm(self, x: str, weight: str) -> str:  # float32 in, float32 out
        g = self.g
        ms = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
        y = g.op("Mul", x, g.op("Pow", g.op("Add", ms, g.const(np.float32(self.eps))), g.const(np.float32(-0.5))))
        return g.op("Mul", y, weight)

    def linear(self, x: str, weight: str) -> str:  # float32 [.., in] -> float32 [.., out]
        if weight in self.quantized:
            n, k, q = *self.quantized[weight], self.quant
            zp = "" if q.symmetric else f"{weight}.zero_points"
            y = self.g.op("MatMulNBits", self.stored(x), f"{weight}.q", f"{weight}.scales", zp, domain="com.microsoft",
                          K=k, N=n, bits=q.bits, block_size=q.block_size, accuracy_level=q.accuracy_level)
        else:
            y = self.g.op("MatMul", self.stored(x), weight)
        return self.f32(y)

    def f32(self, x: str) -> str:
        return x if self.dtype == "fp32" else self.g.op("Cast", x, to=1)

    def stored(self, x: str) -> str:
        return x if self.dtype == "fp32" else self.g.op("Cast", x, to=ONNX_FLOAT[self.dtype])

    def silu_times(self, gate: str, up: str) -> str:
        g = self.g
        return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)


@dataclasses.dataclass(frozen=True)
class Positions:
    """What a call's pairs share: batch and seq [1] each, s = Range(S), the RoPE rows of each pair's position
    (cos / sin [B, S, 1, rot]) and the attention mask [B, 1, 1, S, P+S]."""

    batch: str
    seq: str
    s: str
    cos: str
    sin: str
    mask: str


def positions(g: GraphBuilder, rope: RopeSpec, head_dim: int, max_seq: int, like: str) -> Positions:
    """The call's positions (from past_lengths), RoPE rows and mask (from past_starts and past_key.0's length);
    ``like``: an input [B, S, ...] that gives the batch and pairs."""
    cos, sin = rope.cos_sin(head_dim, max_seq)  # [max_seq, rot/2]
    g.add_initializer(numpy_helper.from_array(np.concatenate([cos, cos], -1).astype(np.float32), "rope.cos"))
    g.add_initializer(numpy_helper.from_array(np.concatenate([sin, sin], -1).astype(np.float32), "rope.sin"))
    shape = g.op("Shape", like)
    batch, seq = (g.op("Slice", shape, g.const([i]), g.const([i + 1])) for i in (0, 1))  # [1] each
    s = g.op("Range", g.const(np.int64(0)), g.op("Squeeze", seq, g.const([0])), g.const(np.int64(1)))  # [S]
    starts, ends = g.op("Unsqueeze", "past_starts", g.const([1])), g.op("Unsqueeze", "past_lengths", g.const([1]))
    pos = g.op("Add", ends, g.op("Unsqueeze", s, g.const([0])))  # [B, S] each pair's position
    pos = g.op("Min", pos, g.const(np.int64(max_seq - 1)))  # a padded pair's, kept inside the table
    cos = g.op("Unsqueeze", g.op("Gather", "rope.cos", pos, axis=0), g.const([2]))  # [B, S, 1, rot]
    sin = g.op("Unsqueeze", g.op("Gather", "rope.sin", pos, axis=0), g.const([2]))
    past = g.op("Slice", g.op("Shape", "past_key.0"), g.const([2]), g.const([3]))  # [1] P
    j = g.op("Unsqueeze", g.op("Range", g.const(np.int64(0)), g.op("Squeeze", past, g.const([0])),
                               g.const(np.int64(1))), g.const([0]))  # [1, P]
    held = g.op("And", g.op("GreaterOrEqual", j, starts), g.op("Less", j, ends))  # [B, P]
    held = g.op("Expand", g.op("Unsqueeze", held, g.const([1])), g.op("Concat", batch, seq, past, axis=0))  # [B,S,P]
    causal = g.op("LessOrEqual", g.op("Unsqueeze", s, g.const([0])), g.op("Unsqueeze", s, g.const([1])))  # [S, S]
    causal = g.op("Expand", g.op("Unsqueeze", causal, g.const([0])), g.op("Concat", batch, seq, seq, axis=0))
    visible = g.op("Concat", held, causal, axis=-1)  # [B, S, P+S]
    mask = g.op("Unsqueeze", g.op("Where", visible, g.const(np.float32(0)), g.const(np.float32(-1e30))),
                g.const([1, 2]))  # [B, 1, 1, S, P+S]
    return Positions(batch, seq, s, cos, sin, mask)


def rope(g: GraphBuilder, x: str, p: Positions, rot: int, d: int) -> str:
    """[B, S, n, D]: the first rot dims rotated (rotate-half)."""
    part, rest = g.op("Split", x, g.const([rot, d - rot]), axis=-1, outputs=2) if rot < d else (x, None)
    lo, hi = g.op("Split", part, g.const([rot // 2, rot // 2]), axis=-1, outputs=2)
    y = g.op("Add", g.op("Mul", part, p.cos), g.op("Mul", g.op("Concat", g.op("Neg", hi), lo, axis=-1), p.sin))
    return y if rest is None else g.op("Concat", y, rest, axis=-1)


def attend(ops: HeadOps, q: str, k: str, v: str, p: Positions, heads: int, kv: int, d: int) -> tuple[str, str, str]:
    """q [B, S, H, D], k / v [B, S, Hkv, D] (RoPE'd, float32) over the cache -> (attention [B, S, H*D] float32,
    new_key, new_value [B, Hkv, S, D] in the head's dtype: the cache owner writes them at M..M+S-1)."""
    g = ops.g
    k_new, v_new = (ops.stored(g.op("Transpose", t, perm=[0, 2, 1, 3])) for t in (k, v))  # [B, Hkv, S, D]
    keys = g.op("Concat", ops.f32("past_key.0"), ops.f32(k_new), axis=2)  # [B, Hkv, P+S, D] as the cache holds them
    values = g.op("Concat", ops.f32("past_value.0"), ops.f32(v_new), axis=2)
    q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 1, 3]), g.const([0, kv, heads // kv, -1, d]))  # [B,Hkv,G,S,D]
    scores = g.op("MatMul", g.op("Mul", q, g.const(np.float32(d ** -0.5))),
                  g.op("Unsqueeze", g.op("Transpose", keys, perm=[0, 1, 3, 2]), g.const([2])))  # [B,Hkv,G,S,P+S]
    att = g.op("MatMul", g.op("Softmax", g.op("Add", scores, p.mask), axis=-1),
               g.op("Unsqueeze", values, g.const([2])))  # [B, Hkv, G, S, D]
    att = g.op("Reshape", g.op("Transpose", att, perm=[0, 3, 1, 2, 4]), g.const([0, 0, heads * d]))  # [B, S, H*D]
    return att, k_new, v_new


def last_rows(g: GraphBuilder, x: str, p: Positions, width: int) -> str:
    """x [B, S, width] -> [B, width] at each row's last real pair (b*S + n_b - 1)."""
    rows = g.op("Add", g.op("Mul", g.op("Range", g.const(np.int64(0)), g.op("Squeeze", p.batch, g.const([0])),
                                        g.const(np.int64(1))), g.op("Squeeze", p.seq, g.const([0]))),
                g.op("Sub", "seq_lengths", g.const(np.int64(1))))
    return g.op("Gather", g.op("Reshape", x, g.const([-1, width])), rows, axis=0)
