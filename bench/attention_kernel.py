"""Decode-attention kernel bandwidth vs a measured device copy (needs an NVIDIA GPU, torch CUDA, Triton).

    python bench/attention_kernel.py [--heads 32 --kv-heads 8 --head-dim 128 --dtype float16]
                                     [--contexts 512 1024 2048 4096 8192 16384] [--batches 1 8] [--json out.json]

For each (batch, context) the cache holds exactly ``context`` tokens per row; one decode step
(RoPE + KV write + split-K attention + reduce, plugins/kernels/launch.py) must read every K/V
byte once:  bytes = 2 * batch * kv_heads * context * head_dim * element size. Achieved GB/s =
bytes / median time, reported next to a device-to-device copy of a buffer of the same size
(read + write, so its GB/s counts both directions) -- the practical ceiling. Times are CUDA-event
medians over ``--iters`` runs after warm-up. It cannot run on a CPU-only machine.

By default both the step and the copy are captured in a CUDA graph of ``--reps`` back-to-back
launches and the graph's time is divided by ``--reps``: that is how the decode engine runs them
(CUDA-graph replay), and it keeps the host's launch cost out of a kernel figure. ``--eager``
times one Python-launched call per event pair instead, which on the H200 (2026-12-04) was flat
at ~115 us from 4 to 64 MiB: launch-bound, not a kernel figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def cuda_time_ms(fn, iters: int, reps: int = 0) -> float:
    """Median ms of one ``fn()``: eager per call (reps=0), or a CUDA graph of ``reps`` calls / reps."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if reps:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # Triton/cuBLAS warm-up off the capture, as torch requires
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / max(reps, 1)


def copy_gbps(nbytes: int, iters: int, reps: int = 0) -> float:
    """Device copy bandwidth (read + write bytes per second) for a buffer of ``nbytes``."""
    import torch

    src = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters, reps)
    return 2 * src.numel() / ms / 1e6


def attention_step(batch: int, context: int, args: argparse.Namespace, dev: str = "cuda"):
    """A callable running one decode step and the K/V bytes it must read."""
    import torch

    from decodert.plugins.kernels.decode_attention import num_splits
    from decodert.plugins.kernels.launch import Dims, cached_attention

    h, hkv, d, smax = args.heads, args.kv_heads, args.head_dim, context + 1
    dt = getattr(torch, args.dtype)
    q = torch.randn(batch, 1, h * d, dtype=dt, device=dev)
    k, v = (torch.randn(batch, 1, hkv * d, dtype=dt, device=dev) for _ in range(2))
    key, value = (torch.randn(batch, hkv, smax, d, dtype=dt, device=dev) for _ in range(2))
    past = torch.full((batch,), context, dtype=torch.int64, device=dev)  # the query sees context + 1 keys
    cos, sin = (torch.randn(smax, d // 2, dtype=dt, device=dev) for _ in range(2))
    y = torch.empty(batch, 1, h * d, dtype=dt, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 132
    n = num_splits(batch, hkv, smax, sm_count=sms)
    scratch = {"q_rot": torch.empty(batch, 1, h, d, dtype=dt, device=dev), "nsplit": n,
               "part_acc": torch.empty(batch, h, n, d, device=dev), "part_ml": torch.empty(batch, h, n, 2, device=dev)}
    dims = Dims(batch, 1, h, hkv, d, smax, d // 2)

    def step() -> None:
        cached_attention(q, k, v, key, value, past, cos, sin, y, scratch, dims=dims, scale=d ** -0.5, window=0)

    return step, 2 * batch * hkv * (context + 1) * d * key.element_size(), n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=20, help="launches per captured CUDA graph (default 20)")
    p.add_argument("--eager", action="store_true", help="time Python-launched calls, no CUDA graph")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/attention_kernel.py needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    rows = []
    timing = "eager launches" if args.eager else f"CUDA graph of {args.reps} launches"
    print(f"{torch.cuda.get_device_name(0)}  H={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}, {timing}")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'MiB':>8} {'us':>8} {'GB/s':>8} {'copy GB/s':>9} {'% copy':>7}")
    for batch in args.batches:
        for context in args.contexts:
            step, nbytes, n = attention_step(batch, context, args)
            reps = 0 if args.eager else args.reps
            ms = cuda_time_ms(step, args.iters, reps)
            gbps, ceiling = nbytes / ms / 1e6, copy_gbps(nbytes, args.iters, reps)
            row = {"batch": batch, "context": context, "splits": n, "bytes": nbytes, "us": ms * 1e3, "gbps": gbps,
                   "copy_gbps": ceiling, "fraction_of_copy": gbps / ceiling}
            rows.append(row)
            print(f"{batch:>5} {context:>7} {n:>6} {nbytes / 2**20:>8.1f} {ms * 1e3:>8.1f} {gbps:>8.0f} "
                  f"{ceiling:>9.0f} {100 * gbps / ceiling:>6.0f}%")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "args": vars(args) | {"json": None},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
