"""decodert's ort prefill graph on OpenVINO's runtime, as the frontend translates it (placement's ``openvino-native``)
and lowered by runtime/backends/openvino/lowering.py (``openvino-sdpa``, ``openvino-paged``), beside OpenVINO GenAI's own IR, in one
process, alternated: the first call at the length, the fastest of ``--rounds`` later calls, and where that fastest
call spent its time (OpenVINO's performance counters, summed per node type and kernel).

    python bench/ov_graphs.py ARTIFACT [--ovgenai FOLDER] --len 128 [--rounds 8] [--threads 2]

In one process (not a fresh one per run, as bench/ov_prefill.py does) so that a loaded machine's noise, which
hits every graph alike within a round, leaves the fastest runs comparable. GenAI's IR (``optimum-cli export
openvino``) is compiled with the same properties and its lm head fed the last position only, as its pipeline
does; its K/V live in its own variables (reset before every call). Fresh pseudo-random ids every call.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def ours(artifact: Path, props: dict, lowering: str) -> tuple[Any, Callable]:
    from decodert.runtime.backends.openvino.native import NativePrefill

    m = json.loads((artifact / "manifest.json").read_text())
    runner = NativePrefill(artifact / m["graphs"]["prefill"]["file"], props["INFERENCE_NUM_THREADS"], lowering=lowering)
    layers, heads, dim = m["kv"]["num_layers"], m["kv"]["num_kv_heads"], m["kv"]["head_dim"]
    empty = Empty(layers, heads, dim)

    def feeds(n: int, seed: int) -> dict:  # a fresh prompt: nothing held
        return runner.feeds(empty, 0, np.random.default_rng(seed).integers(0, m["model"]["vocab_size"], n))

    return runner.request, feeds


class Empty:
    """What NativePrefill.feeds reads of a cache holding nothing: lengths, layer numbers, [1, H_kv, 0, D] buffers."""

    def __init__(self, layers: int, heads: int, dim: int) -> None:
        self.lengths = np.zeros(1, np.int64)
        self.kv_layers = list(range(layers))
        self.buffers = [np.zeros((1, heads, 0, dim), np.float32) for _ in range(2 * layers)]


def genai(folder: Path, props: dict) -> tuple[Any, Callable]:
    import openvino as ov
    import openvino.opset13 as op

    core = ov.Core()
    model = core.read_model(str(folder / "openvino_model.xml"))
    head = model.get_results()[0].input_value(0).get_node()
    while head.get_type_name() != "MatMul":
        head = head.input_value(0).get_node()
    last = op.gather(head.input_value(0), op.constant(np.array([-1], np.int64)), op.constant(np.array(1, np.int64)))
    head.input(0).replace_source_output(last.output(0))
    req = core.compile_model(model, "CPU", props).create_infer_request()
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]

    def feeds(n: int, seed: int) -> dict:
        req.reset_state()
        return {"input_ids": np.random.default_rng(seed).integers(0, vocab, (1, n)), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n).reshape(1, n), "beam_idx": np.zeros(1, np.int32)}

    return req, feeds


def main() -> int:
    p = argparse.ArgumentParser(prog="bench/ov_graphs.py", description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--ovgenai", type=Path)
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args()
    props = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": args.threads, "PERF_COUNT": True}
    import os

    os.environ["DECODERT_OPENVINO_CONFIG"] = json.dumps({"INFERENCE_PRECISION_HINT": "bf16", "PERF_COUNT": True})
    from decodert.runtime.backends.ort.backend import OPENVINO_RUNTIME

    runs = {name: ours(args.artifact, props, lowering) for name, lowering in OPENVINO_RUNTIME.items()}
    if args.ovgenai:
        runs["openvino-genai-ir"] = genai(args.ovgenai, props)
    first = {}
    for name, (req, feeds) in runs.items():
        req.infer(feeds(16, 1))
        f = feeds(args.len, 2)
        t = time.perf_counter()
        req.infer(f)
        first[name] = (time.perf_counter() - t) * 1e3
    best: dict[str, tuple[float, dict]] = {n: (float("inf"), {}) for n in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            req, feeds = runs[name]
            f = feeds(args.len, 100 + r)
            t = time.perf_counter()
            req.infer(f)
            wall = (time.perf_counter() - t) * 1e3
            if wall < best[name][0]:
                agg: dict[str, float] = collections.defaultdict(float)
                for info in req.profiling_info:
                    agg[f"{info.node_type}:{info.exec_type}"] += info.real_time.total_seconds() * 1e3
                best[name] = (wall, agg)
    print(f"{args.len} tokens, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    for name, (wall, agg) in best.items():
        top = "; ".join(f"{k} {v:.1f}" for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[: args.top])
        print(f"{name:<18} first {first[name]:7.0f} ms  fastest of {args.rounds} {wall:7.0f} ms  counters {sum(agg.values()):.0f} ms: {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
