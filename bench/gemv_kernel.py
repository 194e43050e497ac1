"""decodert's own int4 GEMV (the native decode step's kernel, runtime/backends/native/decode_step.c, AVX-512 VNNI)
against ONNX Runtime's MatMulNBits on the same weights: does the kernel beat MLAS at int4 batch 1 (issue 47)?

    python bench/gemv_kernel.py [--shape smollm2|llama-3.2-1b|both] [--threads 2] [--iters 150] [--per-matrix]

The library is the package's (``runtime/backends/native/build.py``: compiled at first use for this CPU into the
decodert cache; x86-64 with AVX-512 VNNI only), its products run outside a model through ``nd_gemv_steps`` on the
step's worker pool. For each shape it makes one decode step's products with random weights (int4, block 32,
asymmetric: fp32 scales and 4-bit zero points), runs them as a session of MatMulNBits nodes (accuracy level 4, the
issue's export) and as the kernel's packed copy (``nd_pack``, as the native step packs them), and times both
**interleaved** (one ORT step, one C step, repeated) so both see the same load; prints the medians and minima,
the bytes each reads per step against ``decodert.tools.bandwidth.memread_gbps`` (the floor of ``decodert bench``),
and the largest error of each against the fp32 product of the dequantized weights. ``--per-matrix`` times
each distinct matrix alone too (small ones then stay in cache: the kernels' compute rate and per-call cost).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from decodert.errors import DecodertError
from decodert.runtime.backends.native import build
from decodert.tools.bandwidth import memread_gbps

SHAPES = {  # (N, K) of one decode step's MatMulNBits, in graph order; the tied head last
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],
    "llama-3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 16 + [(128256, 2048)],
}
P = ctypes.c_void_p


def library() -> ctypes.CDLL:
    """The native decode step's library (exit 2 where it cannot be had: no AVX-512 VNNI, no C compiler)."""
    try:
        return build.library()
    except DecodertError as e:
        raise SystemExit(f"gemv_kernel: {e}") from None


def random_weights(n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits inputs: packed nibbles [N, K/32, 16], scales [N, K/32], zero points [N, ceil(K/64)]."""
    blocks = k // 32
    return (rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8),
            (rng.random((n, blocks), dtype=np.float32) * 0.01 + 0.001).astype(np.float32),
            rng.integers(0, 256, (n, (blocks + 1) // 2), dtype=np.uint8))


def dequantized(q: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
    n, blocks, _ = q.shape
    w = np.empty((n, blocks, 32), np.float32)
    w[:, :, 0::2], w[:, :, 1::2] = q & 15, q >> 4
    zp = np.empty((n, 2 * z.shape[1]), np.float32)
    zp[:, 0::2], zp[:, 1::2] = z & 15, z >> 4
    return ((w - zp[:, :blocks, None]) * s[:, :, None]).reshape(n, blocks * 32)


def ort_session(mats: list, threads: int) -> ort.InferenceSession:
    nodes, inits, outputs = [], [], []
    for i, (q, s, z) in enumerate(mats):
        n, blocks, _ = q.shape
        inits += [numpy_helper.from_array(q, f"q{i}"), numpy_helper.from_array(s.reshape(-1), f"s{i}"),
                  numpy_helper.from_array(z.reshape(-1), f"z{i}")]
        nodes.append(helper.make_node("MatMulNBits", [f"x{blocks * 32}", f"q{i}", f"s{i}", f"z{i}"], [f"y{i}"],
                                      domain="com.microsoft", K=blocks * 32, N=n, bits=4, block_size=32,
                                      accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    widths = sorted({q.shape[1] * 32 for q, _, _ in mats})
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in widths]
    model = helper.make_model(helper.make_graph(nodes, "matmulnbits", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.force_spinning_stop", "1")  # as decodert's sessions
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def compare(lib: ctypes.CDLL, shapes: list[tuple[int, int]], label: str, threads: int, iters: int) -> None:
    rng = np.random.default_rng(0)
    distinct = sorted(set(shapes), key=shapes.index)
    mats = [random_weights(n, k, rng) for n, k in shapes]  # each product its own weights, as a model's layers
    sess = ort_session(mats, threads)
    xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in sorted({k for _, k in shapes})}
    feed = {f"x{k}": x for k, x in xs.items()}
    packed = []
    for (n, k), (q, s, z) in zip(shapes, mats):
        buf = np.empty(lib.nd_packed_bytes(n, k) + 64, np.uint8)
        packed.append(buf[(-buf.ctypes.data) % 64:][: lib.nd_packed_bytes(n, k)])
        lib.nd_pack(q.ctypes.data, s.ctypes.data, z.ctypes.data, n, k, packed[-1].ctypes.data)
    ys = [np.zeros(-(-n // 16) * 16, np.float32) for n, _ in shapes]
    count = len(shapes)
    args = ((P * count)(*[w.ctypes.data for w in packed]), (P * count)(*[xs[k].ctypes.data for _, k in shapes]),
            (ctypes.c_int * count)(*[n for n, _ in shapes]), (ctypes.c_int * count)(*[k for _, k in shapes]),
            (P * count)(*[y.ctypes.data for y in ys]))

    def mine():
        if lib.nd_gemv_steps(count, *args):
            raise SystemExit("gemv_kernel: nd_gemv_steps refused the products (K not a multiple of 32, or no memory)")

    def theirs():
        sess.run(None, feed)

    ref = sess.run(None, feed)
    mine()
    errors = []
    for shape in distinct:
        i = shapes.index(shape)
        exact = dequantized(*mats[i]) @ xs[shape[1]][0]
        scale = float(np.abs(exact).max())
        errors.append(f"{shape[0]}x{shape[1]} {np.abs(ys[i][: shape[0]] - exact).max() / scale:.1e} / "
                      f"{np.abs(ref[i][0] - exact).max() / scale:.1e}")
    for _ in range(5):
        theirs()
        mine()
    t_ort, t_c = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        theirs()
        t1 = time.perf_counter()
        mine()
        t_ort.append(t1 - t0)
        t_c.append(time.perf_counter() - t1)
    # bytes each reads per step: MatMulNBits' inputs (nibbles, fp32 scales, 4-bit zero points); the packed copy
    ort_bytes = sum(n * (k // 32) * 20 + n * ((k // 32 + 1) // 2) for n, k in shapes)
    c_bytes = sum(w.nbytes for w in packed)
    mo, mc = statistics.median(t_ort), statistics.median(t_c)
    print(f"{label}: {count} products, {threads} threads, {iters} interleaved steps")
    print(f"  MatMulNBits (acc 4): median {mo * 1e3:7.3f} ms, min {min(t_ort) * 1e3:7.3f} ms "
          f"({ort_bytes / 1e6:.1f} MB: {ort_bytes / min(t_ort) / 1e9:.1f} GB/s at the min)")
    print(f"  decode_step.c:       median {mc * 1e3:7.3f} ms, min {min(t_c) * 1e3:7.3f} ms "
          f"({c_bytes / 1e6:.1f} MB: {c_bytes / min(t_c) / 1e9:.1f} GB/s at the min)"
          f"  -> x{mo / mc:.2f} (median), x{min(t_ort) / min(t_c):.2f} (min)")
    print(f"  max error / max |y|, C / ORT: {'; '.join(errors)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=150, help="interleaved steps (a tenth of it at the 1B shape)")
    p.add_argument("--per-matrix", action="store_true", help="also time each distinct matrix alone")
    args = p.parse_args(argv)
    lib = library()
    running = lib.nd_start(args.threads)
    if running != args.threads:
        print(f"note: the native step's pool runs {running} threads (started once per process)")
    read = memread_gbps(threads=args.threads)
    print(f"memory read (decodert bench's floor): {read:.1f} GB/s with {args.threads} threads")
    for name in SHAPES if args.shape == "both" else [args.shape]:
        shapes, iters = SHAPES[name], args.iters if name == "smollm2" else max(args.iters // 10, 5)
        compare(lib, shapes, f"{name} decode step", args.threads, iters)
        if args.per_matrix:
            for shape in sorted(set(shapes), key=shapes.index):
                compare(lib, [shape], f"{name} {shape[0]}x{shape[1]} alone", args.threads,
                        args.iters * 2 if shape[0] * shape[1] < 2e7 else max(args.iters // 5, 5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
