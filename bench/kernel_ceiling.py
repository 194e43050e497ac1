"""The int4 decode ceiling of ONNX Runtime's MatMulNBits: one step's products alone, nothing else.

    python bench/kernel_ceiling.py [--artifact OUT] [--batch 1] [--threads 2] [--iters 200]

Builds a session holding only the com.microsoft.MatMulNBits nodes of an int4 artifact's decode
graph (their shapes, bits, block size and accuracy level; random weights of the same size), and
times one run of all of them. Any runtime built on this kernel (decodert, onnxruntime-genai)
cannot decode faster than ``batch / time`` tok/s at that setting, whatever else it does. The
default artifact shapes are SmolLM2-135M's (30 layers of qkv, o, gate_up, down plus the head).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # (N, K)


def shapes_of(artifact: Path) -> tuple[list[tuple[int, int]], int, int, int]:
    """(N, K) of every MatMulNBits in the decode graph, and its bits, block size, accuracy level."""
    graph = onnx.load(str(artifact / "decode.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    if not nodes:
        raise SystemExit(f"{artifact}: no MatMulNBits in decode.onnx (export with --quant on the ort target)")
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    first = attrs[0]
    return [(a["N"], a["K"]) for a in attrs], first["bits"], first["block_size"], first.get("accuracy_level", 0)


def session(shapes: list[tuple[int, int]], bits: int, block: int, level: int, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    nodes, inits, outputs, widths = [], [], [], sorted({k for _, k in shapes})
    for i, (n, k) in enumerate(shapes):
        blocks = -(-k // block)
        inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), f"q{i}"),
                  numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 0.01, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"q{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=block, accuracy_level=level))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["rows", k]) for k in widths]
    model = helper.make_model(helper.make_graph(nodes, "matmulnbits_only", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="an int4/int8 ort artifact (default: SmolLM2 shapes, int4 block 32 acc 4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    shapes, bits, block, level = shapes_of(args.artifact) if args.artifact else (SMOLLM2, 4, 32, 4)
    sess = session(shapes, bits, block, level, args.threads)
    rng = np.random.default_rng(1)
    feed = {i.name: rng.standard_normal((args.batch, i.shape[1])).astype(np.float32) for i in sess.get_inputs()}
    for _ in range(20):
        sess.run(None, feed)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    nbytes = sum(n * -(-k // block) * (block * bits // 8 + 4) for n, k in shapes)  # packed weights + fp32 scales
    print(f"{len(shapes)} MatMulNBits (int{bits}, block {block}, accuracy level {level}, batch {args.batch}, "
          f"{args.threads} threads): {step * 1e3:.2f} ms per step -> at most {args.batch / step:.0f} tok/s; "
          f"{nbytes / 1e6:.1f} MB at {nbytes / step / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
