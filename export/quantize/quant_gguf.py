"""GGUF Q4_0 / Q8_0 blocks -> decodert's block layout (export/quantize/quant.py), exactly.

Q4_0 and Q8_0 are symmetric blocks of 32 values along a row with one fp16 scale ``d``:

    Q4_0  18 bytes: d, then 16 bytes; value j < 16 in the low nibble of byte j, value j + 16 in
          the high nibble; w = d * (q - 8)
    Q8_0  34 bytes: d, then 32 int8 q; w = d * q
    Q4_1  20 bytes: d, m, then 16 bytes as Q4_0; w = d * q + m   (the minimum m is kept as ``mins``)

decodert's symmetric int4 / int8 blocks of 32 store the same numbers: q with zero point 8
(int4, two values per byte, even element in the low nibble: a nibble reorder) or 128 (int8:
q + 128), and the scale d (fp16 -> float32 is exact). So the transcoded weight dequantizes to
exactly what ``gguf.quants.dequantize`` gives, and no float copy of the weight is made.

Which GGUF weights an export transcodes is decided by ``transcoded_as`` (the rule is also
documented in export/quantize/quant.py and ``decodert export --help``).
"""

from __future__ import annotations

import numpy as np

from decodert.export.quantize.quant import QuantConfig, QuantizedWeight, WeightQuant, pack_nibbles
from decodert.export.quantize.weight_layouts import NBITS, WeightLayout

BLOCK = 32
EXACT_BITS = {"Q4_0": 4, "Q8_0": 8, "Q4_1": 4}  # GGUF block types decodert's layout holds exactly -> their bits


def transcoded_as(block_type: str | None, cfg: QuantConfig, layout: WeightLayout = NBITS,
                  gathered: bool = False) -> WeightQuant | None:
    """How a GGUF weight of ``block_type`` is stored, transcoded, under ``cfg``; None: requantize it.

    Transcoding needs block size 32. A Q4_0 weight stays 4-bit in any export (in an int8 export
    it is both smaller and exact); a Q8_0 weight is transcoded in an int8 export, and in an int4
    export only with ``cfg.keep_q8`` (exact, but twice the bytes), else rounded to 4 bits as any
    float weight. Q4_0 and Q8_0 weights are symmetric, whatever ``cfg.symmetric`` says.

    Q4_1 (w = d*q + m) is transcoded only with ``cfg.keep_q4_1``: zero points 0 plus its float
    minimum per block, which the ort target adds as (block sums of x) @ mins; only on the
    layout with a ``block_minimum`` (nbits), not for a table that GatherBlockQuantized reads (it has no minimum), and
    not with ``cfg.symmetric``.
    """
    bits = EXACT_BITS.get(block_type or "")
    if bits is None or cfg.block_size != BLOCK:
        return None
    if block_type == "Q4_1":
        ok = cfg.keep_q4_1 and layout.block_minimum and not gathered and not cfg.symmetric
        return WeightQuant(4, BLOCK, False, "transcoded", block_min=True) if ok else None
    if bits <= cfg.bits or cfg.keep_q8:
        return WeightQuant(bits, BLOCK, True, "transcoded")
    return None


def transcode(raw: np.ndarray, block_type: str, n: int, k: int) -> QuantizedWeight:
    """GGUF blocks of a [n, k] weight (uint8 bytes, row-major) -> QuantizedWeight (symmetric, block 32)."""
    bits = EXACT_BITS[block_type]
    if k % BLOCK:
        raise ValueError(f"a {block_type} row of {k} values is not a whole number of {BLOCK}-blocks")
    blocks = k // BLOCK
    head = 4 if block_type == "Q4_1" else 2  # fp16 d (and Q4_1's fp16 m)
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, blocks, head + BLOCK * bits // 8)
    scales = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, blocks]
    data = b[..., head:]
    if block_type == "Q4_1":  # q as stored (zero point 0), the minimum m kept beside
        mins = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        q = pack_nibbles(np.concatenate([data & 0xF, data >> 4], axis=-1))
        zp = pack_nibbles(np.zeros((n, blocks + blocks % 2), np.uint8))
        return QuantizedWeight(np.ascontiguousarray(q.reshape(n, -1)), scales, zp, n, k, blocks, mins)
    if bits == 4:  # low nibbles are values 0..15, high nibbles 16..31 (already q + 8)
        q = pack_nibbles(np.concatenate([data & 0xF, data >> 4], axis=-1))
    else:  # int8 q -> uint8 q + 128: flip the sign bit
        q = data ^ np.uint8(0x80)
    zp = np.full((n, blocks), 1 << (bits - 1), np.uint8)  # as quantize() stores a symmetric weight's
    if bits == 4:
        zp = pack_nibbles(np.pad(zp, ((0, 0), (0, blocks % 2))))
    return QuantizedWeight(np.ascontiguousarray(q.reshape(n, -1)), scales, zp, n, k, blocks)


def take_rows(qw: QuantizedWeight, order: np.ndarray) -> QuantizedWeight:
    """The weight with its rows reordered (``order[i]`` = source row of row i); blocks run along rows."""
    return QuantizedWeight(qw.q[order], qw.scales[order], qw.zero_points[order], qw.n, qw.k, qw.blocks,
                           None if qw.mins is None else qw.mins[order])


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row-wise concatenation (fused qkv, gate_up) of weights with the same k and layout."""
    if len(parts) == 1:
        return parts[0]
    assert len({(p.k, p.blocks) for p in parts}) == 1, "fused parts must share the input dim"
    cat = lambda xs: np.concatenate(xs, axis=0)  # noqa: E731
    mins = None if parts[0].mins is None else cat([p.mins for p in parts])
    return QuantizedWeight(cat([p.q for p in parts]), cat([p.scales for p in parts]),
                           cat([p.zero_points for p in parts]), sum(p.n for p in parts), parts[0].k, parts[0].blocks,
                           mins)
