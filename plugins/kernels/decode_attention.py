"""Decode attention (S == 1) over the cache, flash-decoding style, GQA-aware.

    q_rot [B,H,D] (roped)   key/value cache [B,Hkv,Smax,D]   past_lengths [B] int64
    row b's query sits at pos = past_lengths[b] and sees keys lo..pos (lo = pos - window + 1, >= 0)

Pass 1, grid (B, Hkv, NSPLIT): program (b, hk, sp) takes split sp of the keys lo..pos (split
length derived on the device from pos, so the launch is the same every step and CUDA-graph
safe), streams its K/V tiles [BLOCK_N, D] once and scores them against all G = H/Hkv query
heads of kv head hk at once ([BLOCK_G, D] x [D, BLOCK_N], BLOCK_G >= 16 for tl.dot): every
cache byte is read by exactly one program. It writes the unnormalised partial output
acc [G, D] and (running max m, sum l) per query head to the workspace.

Pass 2, grid (B, H): y = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from decodert.plugins.kernels.dtypes import precision


@triton.jit
def decode_partial_kernel(q_rot, key_cache, value_cache, past_lengths, part_acc, part_ml,
                          scale, H, HKV, SMAX, NSPLIT, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(past_lengths + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(pos - WINDOW + 1, 0)
    n_keys = pos + 1 - first
    split_len = tl.cdiv(tl.cdiv(n_keys, NSPLIT), BLOCK_N) * BLOCK_N
    lo = first + sp * split_len
    hi = tl.minimum(lo + split_len, pos + 1)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask, dmask = g < G, d < D
    heads = hk * G + g  # the q heads of this kv head
    q = tl.load(q_rot + (b * H + heads)[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)  # softmax denominators
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    base = (b * HKV + hk) * SMAX * D
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        kv_mask = nmask[:, None] & dmask[None, :]
        kt = tl.load(key_cache + base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q.to(kt.dtype), tl.trans(kt), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        vt = tl.load(value_cache + base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m = m_new
    row = (b * H + heads) * NSPLIT + sp  # [BLOCK_G]
    tl.store(part_acc + row[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    tl.store(part_ml + row * 2, m, mask=gmask)
    tl.store(part_ml + row * 2 + 1, den, mask=gmask)


@triton.jit
def decode_reduce_kernel(part_acc, part_ml, out, H, NSPLIT,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64) * H + tl.program_id(1)  # b * H + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask, dmask = s < NSPLIT, d < D
    row = bh * NSPLIT + s
    m = tl.load(part_ml + row * 2, mask=smask, other=float("-inf"))
    den = tl.load(part_ml + row * 2 + 1, mask=smask, other=0.0)
    big = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - big), 0.0)  # empty splits weigh nothing
    acc = tl.load(part_acc + row[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    y = tl.sum(acc * w[:, None], 0) / tl.sum(den * w, 0)
    tl.store(out + bh * D + d, y.to(out.dtype.element_ty), mask=dmask)


def num_splits(batch: int, kv_heads: int, max_seq: int, sm_count: int = 132, block_n: int = 64) -> int:
    """Splits per (row, kv head): about two waves of programs, never more than the cache has tiles."""
    want = triton.cdiv(2 * sm_count, max(batch * kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_seq, block_n), 64))


def decode_attention(q_rot, key_cache, value_cache, past_lengths, out, part_acc, part_ml, *, B: int, H: int,
                     HKV: int, D: int, SMAX: int, scale: float, window: int, nsplit: int, block_n: int = 64) -> None:
    """out [B,H,D] from q_rot [B,H,D]; part_acc [B,H,nsplit,D] and part_ml [B,H,nsplit,2] float32 scratch."""
    g = H // HKV
    block_d = triton.next_power_of_2(D)
    decode_partial_kernel[(B, HKV, nsplit)](q_rot, key_cache, value_cache, past_lengths, part_acc, part_ml,
                                            scale, H, HKV, SMAX, nsplit, WINDOW=window,
                                            PRECISION=precision(key_cache), G=g, D=D,
                                            BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=max(16, block_d),
                                            BLOCK_N=block_n)
    decode_reduce_kernel[(B, H)](part_acc, part_ml, out, H, nsplit, D=D,
                                 BLOCK_S=max(2, triton.next_power_of_2(nsplit)), BLOCK_D=block_d)
