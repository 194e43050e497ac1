"""How a target stores block-quantized weights (the bytes of export/quantize/quant.py's QuantizedWeight).

    nbits  com.microsoft.MatMulNBits (ort): B uint8 [N, blocks, block*bits/8], scales [N*blocks],
           zero points uint8 [N * ceil(blocks*bits/8)]; may keep a per-block minimum (GGUF Q4_1)
           and lets GatherBlockQuantized read a tied embedding from the quantized head.
           GPTQ act-order: B in input order, ``name.g_idx`` int32 [K] (MatMulNBits' g_idx input) and
           zero points unpacked [N, blocks] in the model dtype (ORT 1.32's CPU kernel misreads packed
           ones with g_idx).
    qdq    standard block DequantizeLinear (axis 1) of a [N, Kp] tensor (trt, portable): UINT4/UINT8
           with zero points, or INT4/INT8 without (symmetric; what TensorRT accepts).
           GPTQ act-order: the inputs reordered so each group is one block (``name.perm`` int64 [K];
           the graph gathers the activations' inputs in that order).

A target names its layout (export/lowering/targets.py, through its lowering's ``quant_layout``); the
manifest records ``quant.layout`` = the layout's name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from onnx import TensorProto

from decodert.export.quantize.quant import QuantizedWeight, WeightQuant, pack_nibbles, unpack_nibbles


@dataclass(frozen=True)
class WeightLayout:
    name: str
    gathers_tied_embedding: bool  # a tied embedding is read from the quantized head (no float table)
    block_minimum: bool  # stores a per-block minimum term (w = d*q + m, GGUF Q4_1 kept exactly)

    def write(self, writer: Any, name: str, qw: QuantizedWeight, wq: WeightQuant, dtype: str) -> None:
        """Write ``name.q``, ``name.scales`` (and ``name.zero_points``, ``name.mins``) in this layout."""
        raise NotImplementedError

    def write_stacked(self, writer: Any, name: str, qws: list[QuantizedWeight], wq: WeightQuant, dtype: str) -> None:
        """Write experts ``qws`` (one QuantizedWeight each, same shape) as ``name.q`` [E, N, ...],
        ``name.scales`` [E, N, blocks] (and ``name.zero_points``): what QMoE / a gathered
        DequantizeLinear read."""
        raise NotImplementedError


class NbitsLayout(WeightLayout):
    def write(self, writer: Any, name: str, qw: QuantizedWeight, wq: WeightQuant, dtype: str) -> None:
        n, blocks, bs = qw.n, qw.blocks, wq.block_size
        writer.add_raw(f"{name}.q", qw.q, TensorProto.UINT8, (n, blocks, bs * wq.bits // 8))
        writer.add(f"{name}.scales", qw.scales.reshape(-1), dtype)
        if wq.act_order:
            assert qw.g_idx is not None and wq.bits == 4
            writer.add_raw(f"{name}.g_idx", qw.g_idx.astype(np.int32), TensorProto.INT32, (qw.k,))
            if not wq.symmetric:
                writer.add(f"{name}.zero_points", unpack_nibbles(qw.zero_points)[:, :blocks].astype(np.float32), dtype)
            return
        if not wq.symmetric:
            writer.add_raw(f"{name}.zero_points", qw.zero_points, TensorProto.UINT8, (qw.zero_points.size,))
        if wq.block_min:  # [blocks, N]: the graph multiplies the activations' block sums by it
            assert qw.mins is not None
            writer.add(f"{name}.mins", np.ascontiguousarray(qw.mins.T), dtype)


    def write_stacked(self, writer: Any, name: str, qws: list[QuantizedWeight], wq: WeightQuant, dtype: str) -> None:
        e, n, blocks = len(qws), qws[0].n, qws[0].blocks
        writer.add_raw(f"{name}.q", np.stack([q.q for q in qws]), TensorProto.UINT8, (e, n, qws[0].q.shape[1]))
        writer.add(f"{name}.scales", np.stack([q.scales for q in qws]), dtype)
        if not wq.symmetric:  # per row, padded to whole bytes: QMoE's [E, N, ceil(blocks * bits / 8)]
            zp = np.stack([q.zero_points for q in qws])
            writer.add_raw(f"{name}.zero_points", zp, TensorProto.UINT8, zp.shape)
        assert blocks and not wq.block_min


class QdqLayout(WeightLayout):
    def write(self, writer: Any, name: str, qw: QuantizedWeight, wq: WeightQuant, dtype: str) -> None:
        assert not wq.block_min, "block minimums are stored for the nbits layout only"
        n, blocks = qw.n, qw.blocks
        kp = blocks * wq.block_size
        if wq.act_order:  # inputs in group order: each group one block
            assert qw.g_idx is not None and wq.bits == 4 and kp == qw.k
            perm = np.argsort(qw.g_idx, kind="stable")
            writer.add_raw(f"{name}.perm", perm.astype(np.int64), TensorProto.INT64, (qw.k,))
            qw = replace(qw, q=pack_nibbles(unpack_nibbles(qw.q)[:, perm]), g_idx=None)
        writer.add(f"{name}.scales", qw.scales, dtype)
        if wq.symmetric:  # signed values: q - midpoint, i.e. flip the top bit of every field
            flip = 0x88 if wq.bits == 4 else 0x80
            writer.add_raw(f"{name}.q", qw.q ^ np.uint8(flip), TensorProto.INT4 if wq.bits == 4 else TensorProto.INT8, (n, kp))
            return
        zp = qw.zero_points
        if wq.bits == 4:  # ONNX packs int4 continuously across rows, not per row
            zp = pack_nibbles(np.pad(unpack_nibbles(zp)[:, :blocks].reshape(-1), (0, (n * blocks) % 2)))
        kind = TensorProto.UINT4 if wq.bits == 4 else TensorProto.UINT8
        writer.add_raw(f"{name}.q", qw.q, kind, (n, kp))
        writer.add_raw(f"{name}.zero_points", zp, kind, (n, blocks))


    def write_stacked(self, writer: Any, name: str, qws: list[QuantizedWeight], wq: WeightQuant, dtype: str) -> None:
        """[E * N, Kp], the experts' rows one after another, scales [E * N, blocks]: a 2-D block
        DequantizeLinear, which TensorRT builds (a 3-D one fails in its int4 kernels), reshaped
        to [E, N, Kp] in the graph. K is a whole number of blocks."""
        e, n, blocks = len(qws), qws[0].n, qws[0].blocks
        kp, four = blocks * wq.block_size, wq.bits == 4
        writer.add(f"{name}.scales", np.concatenate([q.scales for q in qws]), dtype)
        q = np.concatenate([q.q for q in qws])
        if wq.symmetric:
            flip = 0x88 if four else 0x80
            writer.add_raw(f"{name}.q", q ^ np.uint8(flip), TensorProto.INT4 if four else TensorProto.INT8, (e * n, kp))
            return
        zp = np.stack([unpack_nibbles(q.zero_points)[:, :blocks] if four else q.zero_points for q in qws])
        if four:  # ONNX packs int4 continuously across the whole tensor
            zp = pack_nibbles(np.pad(zp.reshape(-1), (0, zp.size % 2)))
        kind = TensorProto.UINT4 if four else TensorProto.UINT8
        writer.add_raw(f"{name}.q", q, kind, (e * n, kp))
        writer.add_raw(f"{name}.zero_points", zp, kind, (e * n, blocks))


NBITS = NbitsLayout("nbits", gathers_tied_embedding=True, block_minimum=True)
QDQ = QdqLayout("qdq", gathers_tied_embedding=False, block_minimum=False)
LAYOUTS = {layout.name: layout for layout in (NBITS, QDQ)}
