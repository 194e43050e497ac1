"""The whole CachedAttention op from the kernels, plus what a TensorRT plugin needs to launch them.

    cached_attention(...)      rope+KV write, then decode (S == 1) or prefill attention
    workspace_layout(...)      byte offsets of q_rot / split partials inside one scratch buffer
    DevPtr(ptr, dtype)         a raw device pointer Triton accepts as a tensor argument
    on_stream(stream)          launch Triton kernels on a given CUDA stream (TensorRT's)

Buffers are anything Triton takes as a pointer: torch tensors (tests, benchmarks; CPU ones
under TRITON_INTERPRET=1) or DevPtr (inside the TensorRT plugin). All are contiguous.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from decodert.plugins.kernels.decode_attention import decode_attention, num_splits
from decodert.plugins.kernels.dtypes import ELEMENT_BYTES
from decodert.plugins.kernels.prefill_attention import prefill_attention
from decodert.plugins.kernels.rope_kv import rope_kv_write

ALIGN = 256


@dataclass(frozen=True)
class DevPtr:
    """A device address with a dtype name ("float16", ...): what Triton needs from a tensor."""

    ptr: int
    dtype: str

    def data_ptr(self) -> int:
        return self.ptr

    def offset(self, nbytes: int, dtype: str | None = None) -> "DevPtr":
        return DevPtr(self.ptr + nbytes, dtype or self.dtype)


@contextlib.contextmanager
def on_stream(stream: int) -> Iterator[None]:
    """Make Triton launch on ``stream`` (a cudaStream_t as int) for the duration of the block."""
    from triton.runtime import driver

    active = driver.active
    saved = active.get_current_stream
    active.get_current_stream = lambda *_: stream
    try:
        yield
    finally:
        active.get_current_stream = saved


@dataclass(frozen=True)
class Dims:
    """CachedAttention sizes: batch, new tokens, q heads, kv heads, head dim, cache length, R/2."""

    B: int
    S: int
    H: int
    HKV: int
    D: int
    SMAX: int
    HALF: int


def workspace_layout(dims: Dims, dtype: str, nsplit: int | None = None) -> dict[str, tuple[int, int]]:
    """name -> (byte offset, bytes): q_rot [B,S,H,D] dtype; part_acc [B,H,n,D], part_ml [B,H,n,2] f32.

    n = ``nsplit`` or num_splits(B, ...). A size for every batch up to B: nsplit=num_splits(1, ...)
    (B * n(B) <= B * n(1)); S == 1 can happen in prefill engines too, so the partials are always there.
    """
    n = nsplit or num_splits(dims.B, dims.HKV, dims.SMAX)
    sizes = {"q_rot": dims.B * dims.S * dims.H * dims.D * ELEMENT_BYTES[dtype],
             "part_acc": dims.B * dims.H * n * dims.D * 4, "part_ml": dims.B * dims.H * n * 2 * 4}
    layout, offset = {}, 0
    for name, size in sizes.items():
        layout[name] = (offset, size)
        offset += -(-size // ALIGN) * ALIGN
    layout["total"] = (0, offset)
    layout["nsplit"] = (n, 0)
    return layout


def cached_attention(q, k, v, key_cache, value_cache, past_lengths, cos, sin, y, scratch: dict[str, Any], *,
                     dims: Dims, scale: float, window: int) -> None:
    """y [B,S,H*D]; key_cache/value_cache [B,Hkv,Smax,D] updated in place at past_lengths + s.

    ``scratch``: q_rot [B,S,H,D] (q's dtype), and for S == 1 part_acc / part_ml (float32) with
    ``nsplit`` splits (see workspace_layout).
    """
    d = dims
    rope_kv_write(q, k, v, key_cache, value_cache, scratch["q_rot"], past_lengths, cos, sin,
                  B=d.B, S=d.S, H=d.H, HKV=d.HKV, D=d.D, SMAX=d.SMAX, HALF=d.HALF)
    if d.S == 1:
        decode_attention(scratch["q_rot"], key_cache, value_cache, past_lengths, y, scratch["part_acc"],
                         scratch["part_ml"], B=d.B, H=d.H, HKV=d.HKV, D=d.D, SMAX=d.SMAX, scale=scale,
                         window=window, nsplit=scratch["nsplit"])
    else:
        prefill_attention(scratch["q_rot"], key_cache, value_cache, past_lengths, y, B=d.B, S=d.S, H=d.H,
                          HKV=d.HKV, D=d.D, SMAX=d.SMAX, scale=scale, window=window)
