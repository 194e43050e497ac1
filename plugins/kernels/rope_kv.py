"""Fused RoPE + KV-cache write: one program per (token, head) over q heads then kv heads.

    q [B,S,H,D], k/v [B,S,Hkv,D]      cos/sin [P, R/2]     past_lengths [B] int64
    pos = past_lengths[b] + s
    head <  H:   q_rot[b,s,head,:] = rope(q[b,s,head,:], pos)                 (R dims rotated)
    head >= H:   key_cache[b,h,pos,:] = rope(k[b,s,h,:], pos); value_cache[b,h,pos,:] = v[b,s,h,:]

Rotate-half: for d < R/2: x[d]*cos[d] - x[d+R/2]*sin[d]; for R/2 <= d < R: x[d]*cos[d-R/2] +
x[d-R/2]*sin[d-R/2]; dims >= R pass through.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_row(src, d, cos_ptr, sin_ptr, pos, D: tl.constexpr, HALF: tl.constexpr):
    """One head's D values at ``src`` rotated at position ``pos``, in float32 (d: arange(BLOCK_D))."""
    dmask = d < D
    first = d < HALF
    rot = (d < 2 * HALF) & dmask
    partner = tl.where(first, d + HALF, d - HALF)
    ci = tl.where(first, d, d - HALF)
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * HALF + ci, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + ci, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    return tl.where(rot, x * c + sign * xp * s, x)


@triton.jit
def rope_kv_write_kernel(q, k, v, key_cache, value_cache, q_rot, past_lengths, cos, sin,
                         S, H, HKV, SMAX,
                         D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # b * S + s
    head = tl.program_id(1)
    b = tok // S
    pos = tl.load(past_lengths + b) + tok % S  # int64
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if head < H:
        y = _rope_row(q + (tok * H + head) * D, d, cos, sin, pos, D, HALF)
        tl.store(q_rot + (tok * H + head) * D + d, y.to(q_rot.dtype.element_ty), mask=dmask)
    else:
        h = head - H
        y = _rope_row(k + (tok * HKV + h) * D, d, cos, sin, pos, D, HALF)
        row = ((b * HKV + h) * SMAX + pos) * D
        tl.store(key_cache + row + d, y.to(key_cache.dtype.element_ty), mask=dmask)
        vv = tl.load(v + (tok * HKV + h) * D + d, mask=dmask)
        tl.store(value_cache + row + d, vv, mask=dmask)


def rope_kv_write(q, k, v, key_cache, value_cache, q_rot, past_lengths, cos, sin, *,
                  B: int, S: int, H: int, HKV: int, D: int, SMAX: int, HALF: int) -> None:
    """Launch over (B*S, H+HKV) programs; buffers are contiguous (torch tensors or DevPtr)."""
    rope_kv_write_kernel[(B * S, H + HKV)](q, k, v, key_cache, value_cache, q_rot, past_lengths, cos, sin,
                                           S, H, HKV, SMAX, D=D, HALF=HALF, BLOCK_D=triton.next_power_of_2(D))
