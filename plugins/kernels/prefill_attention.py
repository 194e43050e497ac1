"""Prefill attention: causal flash attention of S new queries over the cache (after the write).

    q_rot [B,S,H,D]  key/value cache [B,Hkv,Smax,D]  past_lengths [B] int64  ->  out [B,S,H,D]
    query s of row b sits at p = past_lengths[b] + s and sees keys j with
    max(0, p - window + 1) <= j <= p       (window = 0: no lower bound)

Grid (cdiv(S, BLOCK_M), B*H): a [BLOCK_M, D] query tile streams key/value tiles [BLOCK_N, D]
of its kv head h // G up to the tile's last position, with an online softmax in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from decodert.plugins.kernels.dtypes import precision


@triton.jit
def prefill_attention_kernel(q_rot, key_cache, value_cache, past_lengths, out,
                             scale, S, H, HKV, SMAX, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                             G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    mb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    past = tl.load(past_lengths + b)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rmask, dmask = rows < S, d < D
    qpos = past + rows  # [BLOCK_M] int64
    q_off = ((b * S + rows) * H + h)[:, None] * D + d[None, :]
    q = tl.load(q_rot + q_off, mask=rmask[:, None] & dmask[None, :], other=0.0)
    hi = tl.minimum(past + tl.minimum((mb + 1) * BLOCK_M, S), SMAX)  # last visible key + 1
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(past + mb * BLOCK_M - WINDOW + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)  # softmax denominators
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    base = (b * HKV + h // G) * SMAX * D
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        kv_mask = (n < hi)[:, None] & dmask[None, :]
        kt = tl.load(key_cache + base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = (n[None, :] <= qpos[:, None]) & (n[None, :] < hi)
        if WINDOW > 0:
            visible = visible & (n[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        den = den * alpha + tl.sum(p, 1)
        vt = tl.load(value_cache + base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m = m_new
    y = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out + q_off, y.to(out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_attention(q_rot, key_cache, value_cache, past_lengths, out, *, B: int, S: int, H: int, HKV: int,
                      D: int, SMAX: int, scale: float, window: int, block_m: int = 64, block_n: int = 64) -> None:
    block_d = max(16, triton.next_power_of_2(D))
    prefill_attention_kernel[(triton.cdiv(S, block_m), B * H)](
        q_rot, key_cache, value_cache, past_lengths, out, scale, S, H, HKV, SMAX, WINDOW=window,
        PRECISION=precision(key_cache), G=H // HKV, D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
