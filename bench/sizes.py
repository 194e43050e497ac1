"""decodert against onnxruntime-genai, OpenVINO GenAI and llama.cpp at the sizes users deploy (0.6B to 4B), random weights.

    python bench/sizes.py [--sizes llama-3.2-1b,qwen3-0.6b,smollm2] [--runtimes decodert-int4,genai-int4,...]
                          [--workloads decode1,decode4,ttft128,ttft1024] [--repeats 3] [--threads 2]
                          [--ov-venv DIR] [--cache ~/.cache/decodert-bench] [--json sizes.json] [--plot sizes.png]

1. Writes each shape's random-weight HF checkpoint once (bench/sizes_models.py) and converts it with
   each runtime's own tools into the cache (kept between runs):
   decodert-fp32 / decodert-int4 (block 32, accuracy level 4; ``--symmetric``) exported from the HF
   folder, decodert-q4_0 transcoded exactly from the Q4_0 GGUF; genai-fp32 / genai-int4 (its model
   builder, block 32, accuracy level 4); ovgenai-fp32 / ovgenai-int4 (optimum-cli export openvino,
   int4 asymmetric, group 32, ratio 1.0, run by the ``--ov-venv`` environment's interpreter through
   bench/ovgenai_worker.py, batch 1 only); llama-f16 / llama-q4_0 (GGUFs written with the gguf package).
   fp32 is skipped where the weights exceed ``--fp32-max-gb``.
2. Workloads: ``ttftN`` (an N-token prompt to its first token) and ``decodeB`` (batch B: a 128-token
   prompt, ``--gen`` tokens, EOS ignored). Each run happens in a fresh worker process (load, a short
   warm-up request, one timed request, peak RSS); within a repeat the runtimes alternate and who
   goes first rotates.
3. Prints medians (min-max) per size, runtime and workload; for decode the bandwidth floor (weight
   bytes + KV bytes per step over the read bandwidth, measured with decodert.tools.bench's probe on a
   ``--probe-mib`` buffer larger than the last-level cache) and the % of it reached; JSON and a plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import sizes_models as M
from install import DEFAULT_OV_VENV
from rotation import rotate
import sizes_report as R

from decodert.export.fetch import smollm2_gguf
from decodert.tools import bench as B

RUNTIMES = ("decodert-fp32", "decodert-int4", "decodert-q4_0", "genai-fp32", "genai-int4", "ovgenai-fp32",
            "ovgenai-int4", "llama-f16", "llama-q4_0")
DEFAULT_SIZES, DEFAULT_WORKLOADS = "llama-3.2-1b", "decode1,decode4,ttft128,ttft1024"
DECODE_PROMPT = 128
MAX_SEQ = 4352  # the longest prompt (4096) + --gen, rounded up: one artifact serves every workload


@dataclasses.dataclass
class Job:
    size: str
    runtime: str
    path: str  # artifact folder, genai folder or GGUF file
    workload: str
    weight_bytes: int = 0  # bytes a batch-1 decode step reads from the weights


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_workload(w: str) -> tuple[int, int]:
    """(batch, prompt_len): decodeB -> (B, 128); ttftN -> (1, N)."""
    if w.startswith("decode") and w[6:].isdigit() and int(w[6:]) >= 1:
        return int(w[6:]), DECODE_PROMPT
    if w.startswith("ttft") and w[4:].isdigit() and 1 <= int(w[4:]) <= MAX_SEQ - 256:
        return 1, int(w[4:])
    raise ValueError(f"unknown workload {w!r} (decode1, decode4, ttft128, ttft1024, ttft4096, ...)")


# ---- preparing -----------------------------------------------------------------------------------
def prepare(size: str, runtime: str, args: argparse.Namespace) -> str | None:
    """The converted model ``runtime`` loads for ``size`` (made once under --cache); None: skipped."""
    cache, shape = args.cache, M.SHAPES[size]
    if runtime.endswith("fp32") and M.params(shape) * 4 > args.fp32_max_gb * 1e9:
        log(f"  {size} {runtime}: skipped (fp32 weights {M.params(shape) * 4 / 1e9:.1f} GB > --fp32-max-gb)")
        return None
    hf = M.hf_checkpoint(size, cache, args.fixture)
    kind, _, prec = runtime.partition("-")
    if kind == "llama":
        return str(M.gguf_from_hf(hf, cache / f"{size}-{prec.upper()}.gguf", prec.upper(), args.fixture))
    if kind == "ovgenai":
        from competitors import build_ovgenai
        from install import ensure_ov_venv

        r = ensure_ov_venv(args.ov_venv)
        if not r.ok:
            log(f"  {size} {runtime}: skipped (OpenVINO GenAI in {args.ov_venv}: {r.note})")
            return None
        return str(build_ovgenai(hf, cache / f"{size}-ovgenai-{prec}", prec, args.ov_venv / "bin" / "python"))
    if kind == "genai":
        from competitors import build_ortgenai

        return str(build_ortgenai(hf, cache / f"{size}-genai-{prec}", prec, args.threads))
    sym = "-sym" if args.symmetric and prec == "int4" else ""
    block = args.block_size if prec == "int4" else 32
    folder = cache / (f"{size}-decodert-{prec}{sym}" + ("" if block == 32 else f"-b{block}"))
    if not (folder / "manifest.json").is_file():
        export(hf if prec != "q4_0" else M.gguf_from_hf(hf, cache / f"{size}-Q4_0.gguf", "Q4_0", args.fixture),
               folder, prec, bool(sym), block)
    return str(folder)


def export(src: Path, folder: Path, prec: str, symmetric: bool, block: int = 32) -> None:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    quant = None if prec == "fp32" else QuantConfig(bits=4, block_size=block, accuracy_level=4, symmetric=symmetric,
                                                    keep_q8=prec == "q4_0")
    export_model(src, folder, max_seq=MAX_SEQ, max_batch=4, progress=False, quant=quant)


def weight_bytes(runtime: str, path: str) -> int:
    """Bytes one batch-1 decode step reads from the weights (row gathers count one row)."""
    from types import SimpleNamespace

    if runtime.startswith("llama"):
        import gguf

        tensors = gguf.GGUFReader(path).tensors
        tied = not any(t.name == "output.weight" for t in tensors)
        return sum(int(t.n_bytes) if tied or t.name != "token_embd.weight" else 0 for t in tensors)
    if runtime.startswith("ovgenai"):  # the whole weights file (its embedding table included)
        return (Path(path) / "openvino_model.bin").stat().st_size
    if runtime.startswith("genai"):
        graph = SimpleNamespace(graphs={"decode": SimpleNamespace(file="model.onnx")},
                                model=SimpleNamespace(extra={}, experts=(0, 0)))
        return B.bytes_per_step(Path(path), graph)  # type: ignore[arg-type]
    from decodert.runtime.backends.loading import read_manifest

    return B.bytes_per_step(Path(path), read_manifest(Path(path)))


# ---- timing: one run per worker process ----------------------------------------------------------
def load_runner(runtime: str, path: str, batch: int, threads: int, n_ctx: int, placement: str | None = None):
    if runtime.startswith("decodert"):
        from decodert.runtime.backends.loading import open_backend, read_manifest
        from decodert.runtime.backends.placement import open_placed

        os.environ["DECODERT_THREADS"] = str(threads)
        manifest = read_manifest(Path(path))
        if placement:  # each phase where --placement says (docs/features/placement.md); measured: cached beside
            return B.BackendRunner(open_placed(Path(path), manifest, placement, threads), batch)
        return B.BackendRunner(open_backend(Path(path), manifest, "ort"), batch)
    from competitors import LlamaCppRunner, OrtGenaiRunner

    if runtime.startswith("genai"):
        return OrtGenaiRunner(Path(path), batch)
    if batch != 1:
        raise ValueError("llama-cpp-python's Llama API decodes one sequence at a time")
    from llama_workaround import disable_extra_buffer_types

    disable_extra_buffer_types()  # its AMX/repacked Q4_0 path segfaults on this Xeon (bench/llama_workaround.py)
    return LlamaCppRunner(Path(path), n_ctx, threads)


def worker(spec: str) -> int:
    job = json.loads(spec)
    batch, prompt_len = parse_workload(job["workload"])
    gen = job["gen"] if job["workload"].startswith("decode") else 1
    runner = load_runner(job["runtime"], job["path"], batch, job["threads"], MAX_SEQ, job.get("placement"))
    runner.run(B.prompt_ids(job["vocab"], 16, seed=1), 4)  # warm-up: thread pools, buffers
    t = runner.run(B.prompt_ids(job["vocab"], prompt_len), gen)
    rss = peak_rss_mb()
    print(json.dumps({"prefill_s": t.prefill_s, "step_s": t.step_s.tolist(), "rss_mb": rss}))
    return 0


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss is inherited through fork, so a worker would report
    its parent's peak, e.g. the 2 GiB bandwidth probe)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_job(job: Job, args: argparse.Namespace) -> dict:
    if job.runtime.startswith("ovgenai"):
        return run_ovgenai_job(job, args)
    spec = {"runtime": job.runtime, "path": job.path, "workload": job.workload, "gen": args.gen,
            "threads": args.threads, "vocab": M.SHAPES[job.size]["vocab_size"], "placement": args.placement}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          timeout=args.timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{job.size} {job.runtime} {job.workload}: worker failed: {tail[:300]}")
    out = json.loads(lines[-1])
    out["load"] = os.getloadavg()[0]
    return out


def run_ovgenai_job(job: Job, args: argparse.Namespace) -> dict:
    """The worker's contract for OpenVINO GenAI, run in its own environment (bench/ovgenai_worker.py):
    the same warm-up (16 other ids) and timed prompt; peak RSS not reported (0)."""
    from competitors import run_ovgenai

    vocab = M.SHAPES[job.size]["vocab_size"]
    batch, prompt_len = parse_workload(job.workload)
    gen = args.gen if job.workload.startswith("decode") else 1
    try:
        t = run_ovgenai(args.ov_venv / "bin" / "python", Path(job.path), B.prompt_ids(vocab, prompt_len), gen,
                        args.threads, 1, B.prompt_ids(vocab, 16, seed=1), args.timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{job.size} {job.runtime} {job.workload}: {e}") from None
    return {"prefill_s": t.prefill_s, "step_s": t.step_s.tolist(), "rss_mb": 0.0, "load": os.getloadavg()[0]}


def measure(jobs: list[Job], args: argparse.Namespace) -> dict[int, list[dict]]:
    """Every job once per repeat; jobs of one (size, workload) alternate, the first rotating. Each run's
    figures are logged as it ends (a long run can be read before its table)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault((j.size, j.workload), []).append(i)

    def one(i: int) -> dict:
        out, job = run_job(jobs[i], args), jobs[i]
        steps = out["step_s"]
        rate = f", {parse_workload(job.workload)[0] * len(steps) / sum(steps):.1f} tok/s" if steps else ""
        log(f"  {job.size} {job.runtime} {job.workload}: TTFT {1e3 * out['prefill_s']:.0f} ms{rate} "
            f"(load {out['load']:.1f})")
        return out

    return rotate(list(groups.values()), args.repeats, one, log)


# ---- the command ---------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/sizes.py", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of {', '.join(M.SHAPES)}")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma list (default: all)")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="comma list of decodeB and ttftN")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gen", type=int, default=128, help="new tokens per decode run")
    p.add_argument("--threads", type=int, default=2, help="threads for every runtime (ORT intra-op, llama.cpp)")
    p.add_argument("--placement", default=None, help="decodert's phases: auto | measure | prefill=B,decode=B "
                   "(docs/features/placement.md; default: every phase on ort, as before)")
    p.add_argument("--symmetric", action="store_true", help="decodert-int4 without zero points")
    p.add_argument("--block-size", type=int, default=32, choices=(32, 64, 128), help="decodert-int4's block")
    p.add_argument("--fp32-max-gb", type=float, default=8.0, help="skip fp32 where the weights are larger")
    p.add_argument("--probe-mib", type=int, default=2048,
                   help="buffer of the read-bandwidth probe (above the last-level cache: 480 MiB here)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "decodert-bench")
    p.add_argument("--ov-venv", type=Path, default=DEFAULT_OV_VENV,
                   help="virtual environment with OpenVINO GenAI and optimum-cli (bench/install.py; made when missing)")
    p.add_argument("--fixture", type=Path, default=None, help="the GGUF the tokenizer comes from (default: `decodert run smollm2`'s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one worker may take")
    p.add_argument("--prepare-only", action="store_true", help="write and convert the checkpoints, measure nothing")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    args.sizes, args.runtimes = _csv(args.sizes, M.SHAPES, "size"), _csv(args.runtimes, RUNTIMES, "runtime")
    args.workloads = args.workloads.split(",")
    for w in args.workloads:
        try:
            parse_workload(w)
        except ValueError as e:
            p.exit(2, f"decodert: error: {e}\n")
    if args.repeats < 1 or args.gen < 2 or args.threads < 1:
        p.exit(2, "decodert: error: --repeats and --threads must be >= 1, --gen >= 2\n")
    args.fixture = args.fixture or smollm2_gguf()
    if not args.fixture.is_file():
        p.exit(2, f"decodert: error: {args.fixture} not found (--fixture: a GGUF with a tokenizer)\n")
    return args


def _csv(value: str, known, what: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in known]
    if bad or not items:
        named = ",".join(bad) or repr(value)
        print(f"decodert: error: unknown {what} {named} (known: {', '.join(known)})",
              file=sys.stderr)
        sys.exit(2)
    return items


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    log(f"machine: {B.machine_info()}; load {os.getloadavg()}")
    jobs = []
    for size in args.sizes:
        for runtime in args.runtimes:
            t0 = time.perf_counter()
            path = prepare(size, runtime, args)
            if path is None:
                continue
            log(f"  {size} {runtime}: {path} ({time.perf_counter() - t0:.0f} s)")
            wb = weight_bytes(runtime, path)
            jobs += [Job(size, runtime, path, w, wb) for w in args.workloads
                     if not (runtime.startswith(("llama", "ovgenai")) and parse_workload(w)[0] > 1)]
    if args.prepare_only:
        return 0
    read = B.memread_gbps(mib=args.probe_mib)  # larger than the last-level cache: DRAM, where the weights live
    log(f"measure: {len(jobs)} jobs x {args.repeats} repeats; memory read {read:.1f} GB/s")
    runs = measure(jobs, args)
    rows = [R.summarize(jobs[i], M.SHAPES[jobs[i].size], v, read, args.gen) for i, v in runs.items()]
    log("\n" + R.table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": B.machine_info(), "read_gbps": read, "argv": argv,
                                         "rows": rows, "runs": {str(i): v for i, v in runs.items()}}, indent=1) + "\n")
    if args.plot:
        R.plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
