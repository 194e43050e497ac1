"""RMSNorm over the last dim, optionally fused with the residual add; one program per row.

    x [R, N] (+ residual [R, N] -> sum [R, N])     weight [N]
    y = (s / sqrt(mean(s^2) + eps)).to(T) * weight       (float32 inside)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x, residual, weight, y, total, N, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < N
    s = tl.load(x + row * N + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(residual + row * N + i, mask=mask, other=0.0).to(tl.float32)
        s = s.to(total.dtype.element_ty)
        tl.store(total + row * N + i, s, mask=mask)
        s = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, 0) / N + eps)
    w = tl.load(weight + i, mask=mask, other=0.0)
    out = (s * inv).to(y.dtype.element_ty) * w
    tl.store(y + row * N + i, out, mask=mask)


def rms_norm(x, weight, y, residual=None, total=None, *, rows: int, n: int, eps: float) -> None:
    """y (and total = x + residual) for ``rows`` rows of ``n``; buffers contiguous."""
    has = residual is not None
    rms_norm_kernel[(rows,)](x, residual if has else x, weight, y, total if has else y, n, eps,
                             HAS_RESIDUAL=has, BLOCK=triton.next_power_of_2(n))
