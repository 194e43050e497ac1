"""Triton kernel cases vs the numpy references (test helper for tests/plugins/test_plugins.py).

Run as a script with TRITON_INTERPRET=1 (CPU): ``python tests/helpers/kernel_cases.py [names...]`` prints
one JSON object {case: [max|err| per output, ...]}. Triton reads TRITON_INTERPRET when a kernel
is decorated (module import), so the CPU run lives in its own process; on a GPU the same
cases run in-process on CUDA tensors (``run_case(name, "cuda")``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

# name -> (B, S, H, HKV, D, SMAX, R, past_lengths, window, dtype)
ATTENTION = {
    "decode_gqa1_d64": (3, 1, 8, 8, 64, 48, 64, [0, 17, 47], 0, "float32"),
    "decode_gqa3_d128_window_partial": (3, 1, 12, 4, 128, 40, 64, [5, 39, 20], 16, "float32"),
    "decode_gqa8_d128_fp16": (2, 1, 8, 1, 128, 96, 128, [3, 95], 0, "float16"),
    "prefill_gqa8_d64_partial": (3, 6, 8, 1, 64, 32, 32, [0, 10, 26], 0, "float32"),
    "prefill_gqa3_d128_window": (2, 9, 6, 2, 128, 64, 128, [0, 40], 8, "float32"),
    "prefill_gqa1_d64_fp16": (2, 5, 4, 4, 64, 32, 64, [0, 20], 0, "float16"),
}
SLOW_ATTENTION = {  # several query tiles and key tiles per program (~10 s interpreted)
    "prefill_long_window": (2, 70, 4, 2, 64, 160, 64, [0, 60], 48, "float32"),
}
# name -> (rows, N, residual, dtype)
RMS = {"rms_plain": (5, 64, False, "float32"), "rms_fused": (7, 96, True, "float32"),
       "rms_fused_fp16": (4, 128, True, "float16")}


def attention_case(spec: tuple, device: str, seed: int = 0) -> list[float]:
    import torch

    from decodert.plugins.ops.cached_attention import cached_attention_ref
    from decodert.plugins.kernels.decode_attention import num_splits
    from decodert.plugins.kernels.launch import Dims, cached_attention

    b, s, h, hkv, d, smax, r, past, window, dtype = spec
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    q, k, v = rand(b, s, h * d), rand(b, s, hkv * d), rand(b, s, hkv * d)
    pk, pv = rand(b, hkv, smax, d), rand(b, hkv, smax, d)
    cos, sin = rand(smax, r // 2), rand(smax, r // 2)
    pl = np.array(past, np.int64)
    ref = cached_attention_ref(q, k, v, pk, pv, pl, cos, sin, num_heads=h, kv_num_heads=hkv, sliding_window=window)

    def t(a: np.ndarray) -> Any:
        return torch.from_numpy(a.copy()).to(device)

    key, value, y = t(pk), t(pv), torch.empty(b, s, h * d, dtype=getattr(torch, dtype), device=device)
    n = num_splits(b, hkv, smax)
    scratch = {"q_rot": torch.empty(b, s, h, d, dtype=y.dtype, device=device), "nsplit": n,
               "part_acc": torch.empty(b, h, n, d, device=device), "part_ml": torch.empty(b, h, n, 2, device=device)}
    cached_attention(t(q), t(k), t(v), key, value, t(pl), t(cos), t(sin), y, scratch,
                     dims=Dims(b, s, h, hkv, d, smax, r // 2), scale=d ** -0.5, window=window)
    got = [y, key, value]
    return [float(np.abs(g.float().cpu().numpy() - e.astype(np.float32)).max()) for g, e in zip(got, ref)]


def rms_case(spec: tuple, device: str, seed: int = 0) -> list[float]:
    import torch

    from decodert.plugins.kernels.rms_norm import rms_norm
    from decodert.plugins.ops.rms_norm import rms_norm_ref

    rows, n, fused, dtype = spec
    rng = np.random.default_rng(seed)
    x, res, w = (rng.standard_normal(shape).astype(dtype) for shape in ((rows, n), (rows, n), (n,)))
    ref = rms_norm_ref(x, w, res if fused else None, epsilon=1e-5)
    t = lambda a: torch.from_numpy(a.copy()).to(device)  # noqa: E731
    y = torch.empty(rows, n, dtype=getattr(torch, dtype), device=device)
    total = torch.zeros_like(y)
    rms_norm(t(x), t(w), y, t(res) if fused else None, total if fused else None, rows=rows, n=n, eps=1e-5)
    got = [y, total] if fused else [y]
    return [float(np.abs(g.float().cpu().numpy() - e.astype(np.float32)).max()) for g, e in zip(got, ref)]


def cuda_available() -> bool:
    """A GPU for compiled Triton kernels (not the CPU interpreter)."""
    import os

    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available()) and os.environ.get("TRITON_INTERPRET") != "1"


def run_case(name: str, device: str = "cpu", seed: int = 0) -> list[float]:
    cases = {**ATTENTION, **SLOW_ATTENTION}
    if name in cases:
        return attention_case(cases[name], device, seed)
    return rms_case(RMS[name], device, seed)


def main(names: list[str]) -> None:
    seed = int(names.pop(0)) if names and names[0].isdigit() else 0
    names = names or [*ATTENTION, *RMS]
    print(json.dumps({name: run_case(name, "cpu", seed) for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
