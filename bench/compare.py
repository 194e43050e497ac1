"""decodert side by side with onnxruntime-genai, OpenVINO GenAI and llama.cpp on one checkpoint, in one run.

    python bench/compare.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work /tmp/decodert-compare]
                            [--repeats 5] [--warmup 1] [--prompt-len 128] [--gen 128] [--threads 2]
                            [--max-seq 512] [--ov-venv DIR] [--runtimes decodert,openvino-genai,...]
                            [--batch4] [--max-load 0.8] [--wait 600] [--json compare.json]

1. pip-installs onnxruntime-genai (+ onnx-ir for its builder) and llama-cpp-python by name when
   missing (bench/install.py; llama.cpp builds from source, the time is printed), and OpenVINO GenAI
   with optimum-intel into the virtual environment ``--ov-venv`` (made when missing).
2. Converts the checkpoint with each runtime's own tools into ``--work`` (kept between runs):
   decodert export fp32 and int4 (accuracy level 4, ``--block-size``); onnxruntime-genai's model
   builder fp32 and int4 (accuracy level 4, symmetric, ``--block-size``); for llama.cpp the Q4_1
   GGUF as is and an F32 GGUF (bench/competitors.py). Also a Q4_0 GGUF (the Q4_1 matrices
   requantized with the gguf package): llama.cpp runs it as is and decodert transcodes every block
   exactly, so that pair ("q4_0") computes with bit-identical weights. OpenVINO GenAI: optimum-cli's
   int4 (asymmetric, group ``--block-size``, ratio 1.0) and fp32 exports of the same HF folder,
   run by the venv's interpreter with ``INFERENCE_NUM_THREADS`` = ``--threads`` (bench/ovgenai_worker.py;
   its warm-up uses other ids than the timed prompt, so its prefix cache never hits).
3. Times the same greedy workload (fixed prompt ids, ``--gen`` new tokens, EOS ignored) on each,
   alternating between runtimes within every repeat. Every repeat of every runtime runs in a fresh
   worker process (load, ``--warmup`` untimed runs, one timed run), so no runtime's idle threads
   (ONNX Runtime's spinning pool, llama.cpp's OpenMP team) or memory share the CPU with another's.
4. Prints the table and decodert's decode/prefill speed ratio against each runtime at the
   matching precision (fp32 vs fp32, int4 vs int4 / Q4_1, q4_0 vs Q4_0). A runtime that cannot be installed,
   converted or loaded is reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from install import DEFAULT_OV_VENV, ensure, ensure_ov_venv
from rotation import rotate

from decodert.export.fetch import smollm2_gguf
from decodert.tools import bench as B

RUNTIMES = ("decodert", "onnxruntime-genai", "openvino-genai", "llama.cpp")


@dataclass
class Contender:
    runtime: str  # decodert | onnxruntime-genai | openvino-genai | llama.cpp
    precision: str  # fp32 | int4
    batch: int
    path: str  # what the worker loads: an artifact folder, a genai folder or a GGUF file
    step_bytes: int = 0  # weight bytes per decode step, where known (decodert)
    note: str = ""


def log(msg: str) -> None:
    print(msg, flush=True)


def timed(what: str, fn: Callable[[], Any]) -> Any:
    """Run a preparation step; on failure print why and return None (the comparison goes on)."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # a competitor that fails to convert or load must not stop the others
        log(f"  {what}: FAILED after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {str(e)[:300]}")
        return None
    log(f"  {what}: {time.perf_counter() - t0:.1f} s")
    return out


# ---- preparing each runtime --------------------------------------------------------------------
def decodert_contenders(args: argparse.Namespace) -> list[Contender]:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig
    from decodert.runtime.backends.loading import read_manifest

    out = []
    int4 = QuantConfig(bits=4, block_size=args.block_size, accuracy_level=4)
    exact = QuantConfig(bits=4, block_size=32, accuracy_level=4, keep_q8=True)  # every block transcoded
    for precision, quant, src in (("fp32", None, args.gguf), ("int4", int4, args.gguf), ("q4_0", exact, args.q4_0)):
        folder = args.work / (f"decodert_{precision}" + (f"_b{args.block_size}" if precision == "int4" else "")
                              + (f"_s{args.max_seq}" if args.max_seq != 512 else ""))
        if src is None:
            continue
        if not (folder / "manifest.json").is_file():
            if timed(f"decodert export {precision}", lambda: export_model(
                    src, folder, max_seq=args.max_seq, max_batch=4, progress=False, quant=quant)) is None:
                continue
        step_bytes = B.bytes_per_step(folder, read_manifest(folder))
        for batch in args.batches:
            out.append(Contender("decodert", precision, batch, str(folder), step_bytes))
    return out


def ortgenai_contenders(args: argparse.Namespace) -> list[Contender]:
    from competitors import build_ortgenai, make_hf_folder

    hf = timed("HF folder from the GGUF (transformers)", lambda: make_hf_folder(args.gguf, args.work / "hf"))
    if hf is None:
        return []
    out = []
    for precision in ("fp32", "int4"):
        name = f"ortgenai_{precision}" + (f"_b{args.block_size}" if precision == "int4" else "")
        folder = timed(f"onnxruntime-genai builder {precision}",
                       lambda: build_ortgenai(hf, args.work / name, precision, args.threads, args.block_size))
        for batch in args.batches if folder is not None else ():
            out.append(Contender("onnxruntime-genai", precision, batch, str(folder)))
    return out


def ovgenai_contenders(args: argparse.Namespace) -> list[Contender]:
    from competitors import build_ovgenai, make_hf_folder

    hf = timed("HF folder from the GGUF (transformers)", lambda: make_hf_folder(args.gguf, args.work / "hf"))
    if hf is None:
        return []
    out = []
    python = args.ov_venv / "bin" / "python"
    for precision in ("fp32", "int4"):
        name = f"ovgenai_{precision}" + (f"_g{args.block_size}" if precision == "int4" else "")
        folder = timed(f"optimum-cli export openvino {precision}",
                       lambda: build_ovgenai(hf, args.work / name, precision, python, args.block_size))
        if folder is not None:
            out.append(Contender("openvino-genai", precision, 1, str(folder), note="asym" * (precision == "int4")))
    if 4 in args.batches:
        log("  openvino-genai batch 4: skipped (bench/ovgenai_worker.py times one token stream)")
    return out


def llamacpp_contenders(args: argparse.Namespace) -> list[Contender]:
    from competitors import make_f32_gguf

    f32 = timed("F32 GGUF (gguf package)", lambda: make_f32_gguf(args.gguf, args.work / "llamacpp_f32.gguf"))
    out = []
    for precision, path, label in (("fp32", f32, "F32"), ("int4", args.gguf, "Q4_1"),
                                   ("q4_0", args.q4_0, "Q4_0")):
        if path is not None:
            out.append(Contender("llama.cpp", precision, 1, str(path), note=label))
    if 4 in args.batches:
        log("  llama.cpp batch 4: skipped (llama-cpp-python's Llama API decodes one sequence at a time)")
    return out


# ---- timing (each run in a fresh worker process) ------------------------------------------------
def load_runner(c: Contender, threads: int) -> Any:
    """In the worker: the runtime's runner for ``c`` (same timing contract: run(ids, gen) -> RunTiming)."""
    if c.runtime == "decodert":
        from decodert.runtime.backends.loading import open_backend, read_manifest

        os.environ["DECODERT_THREADS"] = str(threads)
        folder = Path(c.path)
        return B.BackendRunner(open_backend(folder, read_manifest(folder), "ort"), c.batch)
    from competitors import LlamaCppRunner, OrtGenaiRunner

    if c.runtime == "onnxruntime-genai":
        return OrtGenaiRunner(Path(c.path), c.batch)
    return LlamaCppRunner(Path(c.path), 512, threads)


def worker(spec: str) -> int:
    """``--worker JSON``: load one runtime, warm up, time one run; print the timing as JSON."""
    job = json.loads(spec)
    c = Contender(**job["contender"])
    runner = load_runner(c, job["threads"])
    ids = B.prompt_ids(49152, job["prompt_len"])
    for _ in range(job["warmup"]):
        runner.run(ids, job["gen"])
    t = runner.run(ids, job["gen"])
    print(json.dumps({"prefill_s": t.prefill_s, "step_s": t.step_s.tolist()}))
    return 0


def run_in_worker(c: Contender, args: argparse.Namespace) -> B.RunTiming:
    if c.runtime == "openvino-genai":  # in its own environment's interpreter
        from competitors import run_ovgenai

        try:
            return run_ovgenai(args.ov_venv / "bin" / "python", Path(c.path), B.prompt_ids(49152, args.prompt_len),
                               args.gen, args.threads, args.warmup, B.prompt_ids(49152, args.prompt_len, seed=1))
        except RuntimeError as e:
            raise RuntimeError(f"{c.runtime} {c.precision}: {e}") from None
    job = {"contender": dataclasses.asdict(c), "threads": args.threads, "prompt_len": args.prompt_len,
           "gen": args.gen, "warmup": args.warmup}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          timeout=1800)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{c.runtime} {c.precision} batch {c.batch} worker failed: {tail[:300]}")
    out = json.loads(lines[-1])
    return B.RunTiming(out["prefill_s"], np.asarray(out["step_s"]))


def measure(contenders: list[Contender], args: argparse.Namespace) -> dict[int, list[B.RunTiming]]:
    """Each contender once per repeat, each run in a fresh worker, rotating who goes first.

    A contender whose worker fails is reported and dropped."""
    return rotate([list(range(len(contenders)))], args.repeats, lambda i: run_in_worker(contenders[i], args), log)


def wait_for_quiet(max_load: float, wait_s: float) -> float:
    """Poll the 1-minute load average until it is below ``max_load`` (other jobs share the CPU)."""
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        log(f"  load avg {load:.2f} > {max_load}: waiting (up to {deadline - time.monotonic():.0f} s more)")
        time.sleep(15)
        load = os.getloadavg()[0]
    return load


def report(contenders: list[Contender], results: list[B.BatchResult]) -> str:
    lines = [f"{'runtime':<18} {'prec':<5} {'batch':>5} {'ttft ms':>22} {'prompt tok/s':>18} "
             f"{'decode tok/s':>20} {'tpot ms':>20} {'GB/s':>6}"]
    for c, r in zip(contenders, results):
        prec = c.precision + (f" {c.note}" if c.note else "")
        gbps = f"{r.gbps.median:6.1f}" if c.step_bytes else f"{'-':>6}"
        lines.append(f"{c.runtime:<18} {prec:<5} {c.batch:>5} {r.ttft_ms.fmt():>22} {r.prompt_tps.fmt(0):>18} "
                     f"{r.decode_tps.fmt():>20} {r.tpot_ms.fmt(2):>20} {gbps}")
    lines.append("")
    lines.append("decodert / other (median decode tok/s; prompt tok/s) at matching precision and batch:")
    for c, r in zip(contenders, results):
        if c.runtime == "decodert":
            continue
        mine = [(d, m) for d, m in zip(contenders, results)
                if d.runtime == "decodert" and (d.precision, d.batch) == (c.precision, c.batch)]
        for _, m in mine:
            lines.append(f"  vs {c.runtime} {c.precision}{' ' + c.note if c.note else ''} batch {c.batch}: "
                         f"decode x{m.decode_tps.median / r.decode_tps.median:.2f}, "
                         f"prefill x{m.prompt_tps.median / r.prompt_tps.median:.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="the checkpoint, a llama-family GGUF (default: `decodert run smollm2`'s)")
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-compare"), help="converted models go here")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-seq", type=int, default=512, help="decodert's cache length (>= --prompt-len + --gen)")
    p.add_argument("--ov-venv", type=Path, default=DEFAULT_OV_VENV,
                   help="virtual environment with OpenVINO GenAI and optimum-cli (made when missing)")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma list of {', '.join(RUNTIMES)}")
    p.add_argument("--block-size", type=int, default=32, choices=(32, 64, 128),
                   help="int4 block size, the same for decodert and onnxruntime-genai (llama.cpp Q4_1 is 32)")
    p.add_argument("--batch4", action="store_true", help="also batch 4 (total decode tok/s) where supported")
    p.add_argument("--max-load", type=float, default=0.8, help="wait until the 1-min load average is below this")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for --max-load before measuring anyway")
    p.add_argument("--skip-install", action="store_true", help="use only what is installed already")
    p.add_argument("--json", type=Path, help="write all results as JSON here")
    args = p.parse_args(argv)
    args.batches = (1, 4) if args.batch4 else (1,)
    args.runtimes = [r for r in args.runtimes.split(",") if r]
    unknown = [r for r in args.runtimes if r not in RUNTIMES]
    if unknown:
        p.error(f"unknown runtime {unknown[0]!r} (--runtimes takes {', '.join(RUNTIMES)})")
    if args.max_seq < args.prompt_len + args.gen:
        p.error(f"--max-seq {args.max_seq} is shorter than --prompt-len + --gen ({args.prompt_len + args.gen})")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    args.gguf = args.gguf or smollm2_gguf()
    if not args.gguf.is_file():
        log(f"compare: error: {args.gguf} not found (--gguf)")
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"machine: {B.machine_info()}")
    available = {name: name in args.runtimes for name in RUNTIMES}
    if not args.skip_install:
        log("install:")
        for module, name in (("onnxruntime_genai", "onnxruntime-genai"), ("onnx_ir", "onnxruntime-genai"),
                             ("llama_cpp", "llama.cpp"), (None, "openvino-genai")):
            if not available[name]:
                continue
            r = ensure(module) if module else ensure_ov_venv(args.ov_venv)
            log(f"  {r.package}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s ({r.note})")
            available[name] = available[name] and r.ok
    log("prepare:")
    from competitors import make_q4_0_gguf

    # one file for both runtimes of the q4_0 pair; None (that pair skipped) if it cannot be written
    args.q4_0 = timed("Q4_0 GGUF (gguf package)",
                      lambda: make_q4_0_gguf(args.gguf, args.work / f"{args.gguf.stem}-as-Q4_0.gguf"))
    contenders = decodert_contenders(args) if available["decodert"] else []
    for name, prepare in (("onnxruntime-genai", ortgenai_contenders), ("openvino-genai", ovgenai_contenders),
                          ("llama.cpp", llamacpp_contenders)):
        if available[name]:
            contenders += timed(f"{name} (all)", lambda: prepare(args)) or []
        else:
            log(f"  {name}: not installed or not in --runtimes, skipped")
    wait_for_quiet(args.max_load, args.wait)
    copy, read = B.memcopy_gbps(), B.memread_gbps()
    log(f"measure ({len(contenders)} runtimes x {args.repeats} repeats, load avg {os.getloadavg()[0]:.2f}):")
    runs = measure(contenders, args)
    contenders = [c for i, c in enumerate(contenders) if i in runs]
    results = [B.summarize(c.batch, args.prompt_len, timings, c.step_bytes)
               for c, timings in zip(contenders, runs.values())]
    log("")
    log(report(contenders, results))
    fp32 = next((c for c in contenders if c.runtime == "decodert" and c.precision == "fp32"), None)
    if fp32 is not None:
        log(f"memory read {read:.1f} GB/s (copy {copy:.1f}); decodert fp32 reads {fp32.step_bytes / 1e6:.0f} MB per "
            f"step -> bandwidth floor {read * 1e9 / fp32.step_bytes:.1f} tok/s at batch 1")
    log(f"load avg {os.getloadavg()}")
    if args.json:
        rows = [{"runtime": c.runtime, "precision": c.precision, "note": c.note, "batch": c.batch,
                 "bytes_per_step": c.step_bytes, **dataclasses.asdict(r)} for c, r in zip(contenders, results)]
        args.json.write_text(json.dumps({"machine": B.machine_info(), "copy_gbps": copy, "read_gbps": read, "args": {
            k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
