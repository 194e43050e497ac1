"""One MatMulNBits node timed alone at block 32 / 64 / 128, accuracy level 4 and 0, with and without
zero points: how much a larger block or a symmetric layout buys the int4 kernel (issue 32).

    python bench/nbits_blocks.py [--k 2048] [--n 22528] [--threads 2]

The default shape is a 1B layer's fused QKV plus gate/up products; its 29 MB fit in a large L3, so
the figures are the kernel's compute rate, not the memory's (bench/kernel_ceiling.py times a whole step).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def session(k: int, n: int, block: int, accuracy: int, zero_points: bool, threads: int):
    blocks = k // block
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 255, (n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.01).astype(np.float32)
    inits, inputs = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")], ["A", "B", "S"]
    if zero_points:
        zp = rng.integers(0, 255, (n * ((blocks + 1) // 2),), dtype=np.uint8)
        inits.append(numpy_helper.from_array(zp, "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=accuracy)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options), packed.nbytes + scales.nbytes


def best_ms(sess: ort.InferenceSession, x: np.ndarray, calls: int = 50, tries: int = 5) -> float:
    for _ in range(20):
        sess.run(None, {"A": x})
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        for _ in range(calls):
            sess.run(None, {"A": x})
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=22528)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    x = np.random.default_rng(1).standard_normal((1, args.k)).astype(np.float32)
    for block in (32, 64, 128):
        for accuracy in (4, 0):
            for zp in (True, False):
                sess, nbytes = session(args.k, args.n, block, accuracy, zp, args.threads)
                ms = best_ms(sess, x)
                print(f"block {block:3d}  accuracy {accuracy}  zero points {'yes' if zp else 'no '}: "
                      f"{ms:.3f} ms  {nbytes / ms / 1e6:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
