"""Weight-only block quantization (int4 / int8) of the linear weights at export.

A weight W [N, K] (checkpoint layout: out, in) is cut into blocks of ``block_size`` along K
(K padded with zeros to a whole number of blocks) and stored as

    q            uint8 values [N, Kp]      int4: two per byte, even element in the low nibble
    scales       [N, Kp / block]           model dtype
    zero_points  uint8 [N, Kp / block]     int4: two per byte (per row, padded to whole bytes)

    W[n, k] ~= (q[n, k] - zero_points[n, k // block]) * scales[n, k // block]

These bytes are exactly what ONNX Runtime's com.microsoft.MatMulNBits reads (B [N, blocks,
block/2]) and, for int4 with an even number of blocks, what a standard block-wise
DequantizeLinear of a UINT4 [N, Kp] tensor reads, so every target shares one layout.

How each weight is stored is a per-weight record (``WeightQuant``: bits, block size, symmetric,
source), carried from the export to the lowering and the manifest, because a weight is either
rounded to nearest from float (``rtn``, the QuantConfig's settings) or, from a GGUF file,
transcoded exactly from its blocks (``transcoded``, export/quantize/quant_gguf.py). The rule:

- with block size 32, a Q4_0 weight is transcoded to int4 and a Q8_0 weight to int8, symmetric
  (no zero points) even when the export asks for asymmetric quantization;
- a Q4_0 weight stays 4-bit in an int8 export too (smaller and exact);
- a Q8_0 weight in an int4 export is rounded to 4 bits like a float weight, unless
  ``keep_q8`` (``--keep-q8``) keeps it 8-bit and exact;
- a Q4_1 weight (w = d*q + m) is rounded to 4 bits like a float weight, unless ``keep_q4_1``
  (``--keep-q4-1``, ort target, asymmetric) keeps its blocks exactly with zero points 0 and its
  float minimum per block, which the graph adds as (block sums of x) @ mins: exact, but three
  more small ops per linear (SmolLM2 decode 23-34% slower);
- everything else (other block sizes, other GGUF types, fused weights whose parts differ in
  type, Hugging Face checkpoints) is dequantized to float and rounded to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.errors import DecodertError

QUANTIZABLE = ("qkv", "q", "o", "gate_up", "up", "down", "linear_in", "linear_out", "mamba_in", "mamba_out")


@dataclass(frozen=True)
class QuantConfig:
    bits: int = 4  # 4 | 8
    block_size: int = 32  # 16 | 32 | 64 | 128 | 256
    accuracy_level: int = 0  # MatMulNBits: 0 = fp32 compute, 4 = int8 activations (faster, less exact)
    symmetric: bool = False  # True: zero point fixed at the midpoint (8 / 128)
    lm_head: bool = True  # quantize the output projection too (a large share of a small model)
    keep_q8: bool = False  # int4 export of a GGUF: keep Q8_0 weights 8-bit (exact) instead of rounding to 4 bits
    keep_q4_1: bool = False  # ort target, GGUF Q4_1 weights: exact, plus a per-block minimum term (slower decode)
    scale_search: bool = True  # pick each block's scale (and zero point) by least squared error, not min/max

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise DecodertError(f"--quant must be int4 or int8 (got {self.bits} bits)")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise DecodertError(f"--block-size must be one of 16, 32, 64, 128, 256 (got {self.block_size})")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise DecodertError(f"--accuracy-level must be 0..4 (got {self.accuracy_level})")

    def applies_to(self, name: str) -> bool:
        return name == "lm_head" and self.lm_head or name.rsplit(".", 1)[-1] in QUANTIZABLE

    def to_dict(self) -> dict:
        return {"bits": self.bits, "block_size": self.block_size, "accuracy_level": self.accuracy_level,
                "symmetric": self.symmetric, "lm_head": self.lm_head, "keep_q8": self.keep_q8,
                "keep_q4_1": self.keep_q4_1, "scale_search": self.scale_search}

    def rtn(self) -> WeightQuant:
        """How a weight rounded to nearest from float under this config is stored."""
        return WeightQuant(self.bits, self.block_size, self.symmetric, "rtn")


@dataclass(frozen=True)
class WeightQuant:
    """How one quantized weight is stored: what its lowering and the manifest need."""

    bits: int  # 4 | 8
    block_size: int
    symmetric: bool  # True: no zero points (fixed at 8 / 128)
    source: str  # "rtn": rounded to nearest from float; "transcoded": copied exactly from GGUF blocks;
    # "gptq" | "awq": copied exactly from a GPTQ / AWQ checkpoint (export/quantize/quant_packed.py)
    block_min: bool = False  # + a float minimum per block (GGUF Q4_1: w = d*q + m); ort target only
    act_order: bool = False  # GPTQ act-order: input k belongs to group g_idx[k], not k // block_size

    def to_dict(self) -> dict:
        return {"bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric, "source": self.source,
                "block_min": self.block_min, "act_order": self.act_order}


@dataclass
class QuantizedWeight:
    q: np.ndarray  # uint8 [N, Kp * bits / 8] packed
    scales: np.ndarray  # float32 [N, blocks]
    zero_points: np.ndarray  # uint8 [N, ceil(blocks * bits / 8)] packed
    n: int
    k: int
    blocks: int
    mins: np.ndarray | None = None  # float32 [N, blocks], added to every value of a block (block_min)
    g_idx: np.ndarray | None = None  # int32 [K] the group of each input (act_order); q stays in input order


def quantize(w: np.ndarray, cfg: QuantConfig) -> QuantizedWeight:
    """Block quantization of W [N, K] (float) -> packed q, scales, zero points.

    Each value is rounded to the nearest step of its block's grid. The grid (scale, zero point)
    comes from the block's min/max, then, with ``cfg.scale_search``, from a least-squares search
    (``_search``): on SmolLM2 it cuts the squared rounding error of the int4 layers by ~20%.
    """
    n, k = w.shape
    bs, qmax = cfg.block_size, (1 << cfg.bits) - 1
    blocks = -(-k // bs)
    wp = np.zeros((n, blocks * bs), np.float32)
    wp[:, :k] = w
    wb = wp.reshape(n, blocks, bs)
    scales, zp = np.empty((n, blocks), np.float32), np.empty((n, blocks), np.float32)
    q = np.empty((n, blocks, bs), np.uint8)
    rows = max(1, CHUNK_VALUES // (blocks * bs))
    for a in range(0, n, rows):  # chunks that stay in the CPU's cache: the search is 3x faster than on whole weights
        chunk = wb[a:a + rows]
        scales[a:a + rows], zp[a:a + rows] = _grid(chunk, cfg)
        q[a:a + rows] = _round(chunk, scales[a:a + rows], zp[a:a + rows], qmax)
    q = q.reshape(n, blocks * bs)
    zp8 = zp.astype(np.uint8)
    if cfg.bits == 4:
        q = pack_nibbles(q)
        zp8 = pack_nibbles(np.pad(zp8, ((0, 0), (0, blocks % 2))))
    return QuantizedWeight(q, scales, zp8, n, k, blocks)


CHUNK_VALUES = 1 << 16  # weight values quantized at once (256 KB of float32)
# candidate shrinkings of the min/max scale (more clipping, finer steps). float64, as the perplexity figures were
# measured: float32 factors search 1.7x faster but moved SmolLM2 int4 perplexity 44.03 -> 44.76
SCALE_FACTORS = np.linspace(0.7, 1.0, 7)


def _safe(scales: np.ndarray) -> np.ndarray:
    """Scales usable as divisors (an all-zero block has scale 0)."""
    return np.where(scales == 0, 1.0, scales)


def _round(wb: np.ndarray, scales: np.ndarray, zp: np.ndarray, qmax: int) -> np.ndarray:
    return np.clip(np.round(wb / _safe(scales)[..., None] + zp[..., None]), 0, qmax)


def _error(wb: np.ndarray, scales: np.ndarray, zp: np.ndarray, qmax: int) -> np.ndarray:
    """Squared rounding error per block of blocks wb [rows, blocks, block] on the grid (scales, zp)."""
    return (((_round(wb, scales, zp, qmax) - zp[..., None]) * scales[..., None] - wb) ** 2).sum(-1)


def _grid(wb: np.ndarray, cfg: QuantConfig) -> tuple[np.ndarray, np.ndarray]:
    """(scales, zero points) [rows, blocks] for blocks wb [rows, blocks, block]."""
    qmax = (1 << cfg.bits) - 1
    if cfg.symmetric:
        mid = 1 << (cfg.bits - 1)
        base = np.abs(wb).max(-1) / (mid - 1)  # [-absmax, absmax] -> mid +- (mid - 1): no clipping
        zp_of = lambda s: np.full(s.shape, mid, np.float32)  # noqa: E731
    else:
        lo, hi = np.minimum(wb.min(-1), 0.0), np.maximum(wb.max(-1), 0.0)
        base = (hi - lo) / qmax
        zp_of = lambda s: np.clip(np.round(-lo / _safe(s)), 0, qmax)  # noqa: E731
    if not cfg.scale_search:
        return base, zp_of(base)
    return _search(wb, base, zp_of, qmax, cfg.symmetric)


def _search(wb: np.ndarray, base: np.ndarray, zp_of, qmax: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares grid per block: the best of ``SCALE_FACTORS`` x the min/max scale, then two
    rounds of refitting the scale (and zero point) to the rounded values."""
    s, z, best_e = base, zp_of(base), np.full(base.shape, np.inf)
    for f in SCALE_FACTORS:
        s_new = base * f
        z_new = zp_of(s_new)
        s, z, best_e = _keep_better(wb, s, z, best_e, s_new, z_new, qmax)
    for _ in range(2):
        d = _round(wb, s, z, qmax) - z[..., None]
        fit = (wb * d).sum(-1) / np.maximum((d * d).sum(-1), 1e-30)
        s_new = np.where(fit > 0, fit, s)
        z_new = z if symmetric else np.clip(np.round(
            (_round(wb, s_new, z, qmax) - wb / _safe(s_new)[..., None]).mean(-1)), 0, qmax)
        s, z, best_e = _keep_better(wb, s, z, best_e, s_new, z_new, qmax)
    return s.astype(np.float32), z.astype(np.float32)


def _keep_better(wb: np.ndarray, s: np.ndarray, z: np.ndarray, best_e: np.ndarray, s_new: np.ndarray,
                 z_new: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block, the grid (s_new, z_new) where it has a strictly smaller error, else (s, z)."""
    e = _error(wb, s_new, z_new, qmax)
    better = e < best_e
    return np.where(better, s_new, s), np.where(better, z_new, z), np.minimum(e, best_e)


def dequantize(qw: QuantizedWeight, wq: WeightQuant | QuantConfig) -> np.ndarray:
    """The float weight the quantized one stands for (reference for tests and error reports)."""
    q, zp = qw.q, qw.zero_points
    if wq.bits == 4:
        q, zp = unpack_nibbles(q), unpack_nibbles(zp)[:, : qw.blocks]
    if qw.g_idx is not None:  # act-order: each input's own group
        g = qw.g_idx
        return (q[:, : qw.k].astype(np.float32) - zp[:, g]) * qw.scales[:, g]
    wb = (q.reshape(qw.n, qw.blocks, wq.block_size).astype(np.float32) - zp[..., None]) * qw.scales[..., None]
    if qw.mins is not None:
        wb = wb + qw.mins[..., None]
    return wb.reshape(qw.n, -1)[:, : qw.k]


def pack_nibbles(v: np.ndarray) -> np.ndarray:
    """uint8 values < 16 [..., 2m] -> bytes [..., m], even element in the low nibble."""
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = b & 0xF, b >> 4
    return out


def quantized_embedding(spec, cfg: QuantConfig | None, layout: Any) -> bool:
    """Whether a tied embedding is stored only once, quantized, as the output projection.

    On a layout that ``gathers_tied_embedding`` (export/quantize/weight_layouts.py: ``nbits``, ONNX Runtime)
    the graph gathers embedding rows straight from the quantized head with
    com.microsoft.GatherBlockQuantized, so the float table is not written: SmolLM2-135M int4
    drops from 200 MB to about 90 MB.
    """
    return bool(spec.tie_word_embeddings and cfg is not None and cfg.lm_head and layout.gathers_tied_embedding)


def write_gather_tables(writer, name: str, qw: QuantizedWeight, wq: WeightQuant, dtype: str) -> None:
    """``name.gather_scales`` (and ``name.gather_zero_points``) [N, blocks, 1] for GatherBlockQuantized.

    It reads ``name.q`` [N, blocks, block*bits/8] as MatMulNBits does, but wants scales and zero
    points with the same rank as the data (one unpacked zero point per block); these copies are
    small (a 1/32 of the weights' element count). A symmetric weight gets none: without them
    GatherBlockQuantized takes the midpoint of uint8 data, 8 for 4 bits and 128 for 8 bits
    (ONNX Runtime 1.32; tests/export/test_gguf_transcode.py checks it against numpy).
    """
    from onnx import TensorProto

    writer.add(f"{name}.gather_scales", qw.scales.reshape(qw.n, qw.blocks, 1), dtype)
    if not wq.symmetric:
        zp = unpack_nibbles(qw.zero_points)[:, : qw.blocks] if wq.bits == 4 else qw.zero_points
        writer.add_raw(f"{name}.gather_zero_points", np.ascontiguousarray(zp), TensorProto.UINT8, (qw.n, qw.blocks, 1))

