"""The ort lowering's causal conv (com.microsoft.CausalConvWithState) against the portable one (Conv, group=C),
each over Concat(state, x) with the per-row state update, alone in a graph (issue 33).

    python bench/causal_conv_op.py --threads 2 [--channels 1024 --kernel 3 --repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

from decodert.plugins.ops import causal_conv as cc
from decodert.plugins.onnx_builder import GraphBuilder


def graph(kind: str, c: int, k: int) -> bytes:
    g = GraphBuilder(f"conv_{kind}", {"": 21, "com.microsoft": 1})
    g.input("x", "fp32", [1, c, "seq"])
    g.input("past_conv.0", "fp32", [1, c, k - 1])
    g.input("seq_lengths", "int64", [1])
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((c, 1, k)).astype(np.float32), "w")
    g.add_initializer(w)
    cat = cc.full_window(g, "x", "past_conv.0")  # as Lowering.causal_conv / OrtLowering.causal_conv build it
    if kind == "portable":
        y = cc.conv_body(g, cat, "w", "", kernel=k, channels=c, activation="none")
    else:
        full, _ = g.op("CausalConvWithState", cat, "w", domain="com.microsoft", outputs=2)
        y = g.op("Slice", full, g.const([k - 1]), g.const([np.iinfo(np.int64).max]), g.const([2]))
    cc.next_state(g, cat, "seq_lengths", k, "present_conv.0")
    g.output(y, "y", "fp32", [1, c, "seq"])
    g.outputs.append(onnx.helper.make_tensor_value_info("present_conv.0", onnx.TensorProto.FLOAT, [1, c, k - 1]))
    return g.to_model(ir_version=10).SerializeToString()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--kernel", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sessions = {kind: ort.InferenceSession(graph(kind, args.channels, args.kernel), so, providers=["CPUExecutionProvider"])
                for kind in ("portable", "ort")}
    rng = np.random.default_rng(1)
    for seq in (1, 512):
        feed = {"x": rng.standard_normal((1, args.channels, seq)).astype(np.float32),
                "past_conv.0": rng.standard_normal((1, args.channels, args.kernel - 1)).astype(np.float32),
                "seq_lengths": np.array([seq], np.int64)}
        outs = {kind: s.run(None, feed) for kind, s in sessions.items()}
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(outs["portable"], outs["ort"]))
        times: dict[str, list[float]] = {kind: [] for kind in sessions}
        for _ in range(args.repeats):  # alternated
            for kind, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feed)
                times[kind].append((time.perf_counter() - t0) * 1e6)
        print(f"C={args.channels} K={args.kernel} seq={seq}: " + ", ".join(
            f"{kind} {statistics.median(v):.1f} us" for kind, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
