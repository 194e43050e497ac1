"""Prefix and conversation K/V reuse (issue 13): what a session and the prefix cache save.

    python bench/prefix.py --artifact FP32_ART [--small-artifact FP32_ART_MAX_SEQ_128]
        [--genai ORTGENAI_FOLDER --genai-python /work/genai-venv/bin/python]
        [--gguf F32.gguf --llama-python /work/llama-venv/bin/python] [--threads 2] [--json out.json]

(a) conversation: ``--turns`` user turns, ``--reply`` greedy tokens each. TTFT per turn for
    decodert through ``llm.session()`` and for decodert re-prefilling the whole history
    (``llm.chat(history)``, prefix cache off); onnxruntime-genai as its API runs a chat without a
    kept generator (a new Generator per turn over the whole rendered history: it has no reuse
    across requests); llama.cpp through llama-cpp-python's ``Llama.create_completion`` on one
    ``Llama``, which itself keeps the longest common prefix of its last prompt's K/V. Every
    contender gets the same rendered token ids (decodert's replies are the history).
(b) ``--requests`` requests sharing a ~400-token system prompt through ``generate_many``: wall
    time with the prefix cache (emptied before each round) and without it; the tokens are compared.
(c) memory (``--small-artifact``): RSS per turn over ``--memory-turns`` turns of a session that
    keeps truncating, and the bytes the prefix cache's entries really hold (summed from the
    blocks) after each of many distinct requests under a tiny budget.

Each contender runs in a fresh worker process (its own interpreter for the competitors), rounds
alternate contenders; medians over ``--rounds``. No figure is asserted here: docs/benchmarks/history.md,
"Prefix and conversation KV reuse (issue 13)".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

USERS = ["Hi! I am planning a trip to Paris in spring. What should I pack?",
         "How many days would you spend there?", "Which museums are worth it?",
         "Is the metro easy to use for a tourist?", "What food should I try?",
         "Any day trips from the city you would suggest?", "How do I get to the airport?",
         "Thanks. Can you sum up the plan in two lines?"]
SYSTEM = "You are a helpful, concise travel assistant."
TOPICS = ["the history of the harbour", "how the lamp was lit", "the keepers' daily routine", "storms at sea",
          "the supply boat", "the fog signal", "the last keeper", "the museum today"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shared_system(text_file: Path, words: int = 300) -> str:
    """About 400 tokens of system prompt: the bench's fixed text repeated to ``words`` words."""
    base = text_file.read_text().split()
    return "You answer questions about this story.\n" + " ".join((base * (words // len(base) + 1))[:words])


# ---- workers (each a fresh process) ----------------------------------------------------------
def w_session(job: dict) -> dict:
    from decodert.runtime.llm import LLM

    llm = LLM.load(job["artifact"], backend="ort", prefix_cache_mb=0)
    llm.generate("Warm up.", max_new_tokens=4, temperature=0)
    session, out = llm.session(system=SYSTEM), []
    for u in job["users"]:
        prompt_ids = [int(t) for t in llm.prepare(session.history + [{"role": "user", "content": u}], chat=True).ids]
        r = session.chat(u, max_new_tokens=job["reply"], temperature=0)
        out.append({"ttft_s": r.metrics.ttft_s, "prompt_tokens": r.metrics.prompt_tokens,
                    "cached_tokens": r.metrics.cached_tokens, "tokens": r.token_ids, "prompt_ids": prompt_ids})
    return {"turns": out, "history": session.history}


def w_full(job: dict) -> dict:
    from decodert.runtime.llm import LLM

    llm = LLM.load(job["artifact"], backend="ort", prefix_cache_mb=0)
    llm.generate("Warm up.", max_new_tokens=4, temperature=0)
    out, history = [], job["history"]
    for k in range(len(job["users"])):
        r = llm.chat(history[: 2 + 2 * k], max_new_tokens=job["reply"], temperature=0)  # system + k turns + user
        out.append({"ttft_s": r.metrics.ttft_s, "prompt_tokens": r.metrics.prompt_tokens, "tokens": r.token_ids})
    return {"turns": out}


def w_genai(job: dict) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(job["folder"])

    def turn(ids: list[int]) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + job["reply"], do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array([ids], np.int32))
        gen.generate_next_token()
        ttft = time.perf_counter() - t0
        while not gen.is_done():
            gen.generate_next_token()
        return {"ttft_s": ttft, "prompt_tokens": len(ids)}

    turn(job["prompts"][0][:8])
    return {"turns": [turn(ids) for ids in job["prompts"]]}


def w_llama(job: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_threads_batch=job["threads"],
                verbose=False)
    llm.create_completion(prompt=job["prompts"][0][:8], max_tokens=2, temperature=0.0)
    out = []
    for ids in job["prompts"]:
        t0, ttft = time.perf_counter(), None
        for _ in llm.create_completion(prompt=ids, max_tokens=job["reply"], temperature=0.0, stream=True):
            ttft = time.perf_counter() - t0 if ttft is None else ttft
        out.append({"ttft_s": ttft, "prompt_tokens": len(ids)})
    return {"turns": out}


def w_shared(job: dict) -> dict:
    from decodert.runtime.llm import LLM, Request
    from decodert.runtime.decoding.sampling import SamplingParams

    llm = LLM.load(job["artifact"], backend="ort", prefix_cache_mb=None if job["cache"] else 0)
    llm.generate("Warm up.", max_new_tokens=4, temperature=0)
    reqs = [Request(messages=[{"role": "system", "content": job["system"]},
                              {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (question {i})."}],
                    params=SamplingParams(max_new_tokens=job["gen"], temperature=0)) for i in range(job["requests"])]
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    t0 = time.perf_counter()
    rs = llm.generate_many(reqs)
    wall = time.perf_counter() - t0
    peak = llm.prefix_cache.stats.peak_bytes if llm.prefix_cache is not None else 0
    return {"wall_s": wall, "tokens": [r.token_ids for r in rs], "prompt_tokens": rs[0].metrics.prompt_tokens,
            "cached_tokens": sum(r.metrics.cached_tokens for r in rs), "peak_bytes": peak}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def w_memory(job: dict) -> dict:
    from decodert.runtime.llm import LLM

    llm = LLM.load(job["artifact"], backend="ort", prefix_cache_mb=job["budget_mb"])
    session, rss, dropped = llm.session(system=SYSTEM), [], 0
    for i in range(job["turns"]):
        session.chat(USERS[i % len(USERS)], max_new_tokens=16, temperature=0)
        dropped += session.last_turn.dropped_turns
        rss.append(_rss_mb())
    cache, held = llm.prefix_cache, []
    for i in range(job["requests"]):  # distinct prompts of growing length: the cache fills and evicts
        llm.generate(f"Request {i}: " + " ".join(TOPICS[: 1 + i % len(TOPICS)]) * (1 + i % 4), max_new_tokens=4,
                     temperature=0)
        held.append(sum(int(e.kv.nbytes) for e in cache._entries.values()))
    return {"rss_mb": rss, "dropped_turns": dropped, "held_bytes": held, "budget_bytes": cache.budget_bytes,
            "block_bytes": cache.block_bytes, "evicted_blocks": cache.stats.evicted_blocks,
            "peak_bytes": cache.stats.peak_bytes}


WORKERS = {"session": w_session, "full": w_full, "genai": w_genai, "llama": w_llama, "shared": w_shared,
           "memory": w_memory}


def run_worker(kind: str, job: dict, python: str, threads: int) -> dict:
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the decodert package
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DECODERT_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([python, __file__, "--worker", json.dumps({"kind": kind, **job})], capture_output=True,
                          text=True, timeout=3600, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{kind}: worker failed: {tail[:300]}")
    return json.loads(lines[-1])


# ---- the three parts -------------------------------------------------------------------------
def conversation(args: argparse.Namespace) -> dict:
    base = {"artifact": str(args.artifact), "users": USERS[: args.turns], "reply": args.reply}
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        log(f"(a) conversation round {r + 1}/{args.rounds}")
        sess = run_worker("session", base, sys.executable, args.threads)
        runs.setdefault("decodert session", []).append(sess)
        job = {**base, "history": sess["history"]}
        runs.setdefault("decodert re-prefill", []).append(run_worker("full", job, sys.executable, args.threads))
        prompts = [t["prompt_ids"] for t in sess["turns"]]
        for name, kind, python, extra in (
                ("onnxruntime-genai", "genai", args.genai_python, {"folder": str(args.genai)} if args.genai else None),
                ("llama.cpp", "llama", args.llama_python,
                 {"gguf": str(args.gguf), "n_ctx": 1024, "threads": args.threads} if args.gguf else None)):
            if extra is None:
                continue
            try:
                runs.setdefault(name, []).append(run_worker(kind, {**extra, "prompts": prompts, "reply": args.reply},
                                                            python, args.threads))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log(f"  {name}: {e}")
    table = {name: [statistics.median(run["turns"][k]["ttft_s"] for run in rs) * 1000 for k in range(args.turns)]
             for name, rs in runs.items()}
    first = runs["decodert session"][0]["turns"]
    same = all(a["tokens"] == b["tokens"] for a, b in zip(first, runs["decodert re-prefill"][0]["turns"]))
    return {"ttft_ms": table, "prompt_tokens": [t["prompt_tokens"] for t in first],
            "cached_tokens": [t["cached_tokens"] for t in first], "same_tokens": same,
            "turn_last_ratio": table["decodert session"][-1] / table["decodert re-prefill"][-1]}


def shared_prompt(args: argparse.Namespace) -> dict:
    job = {"artifact": str(args.artifact), "system": shared_system(Path(__file__).with_name("fixed_text.txt"), args.system_words),
           "requests": args.requests, "gen": args.gen}
    runs: dict[str, list[dict]] = {"cache": [], "no cache": []}
    for r in range(args.rounds):
        log(f"(b) shared system prompt round {r + 1}/{args.rounds}")
        for name in (("no cache", "cache") if r % 2 == 0 else ("cache", "no cache")):
            runs[name].append(run_worker("shared", {**job, "cache": name == "cache"}, sys.executable, args.threads))
    wall = {name: statistics.median(x["wall_s"] for x in rs) for name, rs in runs.items()}
    return {"wall_s": wall, "ratio": wall["cache"] / wall["no cache"], "prompt_tokens": runs["cache"][0]["prompt_tokens"],
            "cached_tokens": runs["cache"][0]["cached_tokens"], "peak_bytes": runs["cache"][0]["peak_bytes"],
            "same_tokens": all(a["tokens"] == b["tokens"] for a in runs["cache"] for b in runs["no cache"])}


def memory(args: argparse.Namespace) -> dict:
    log(f"(c) memory: {args.memory_turns} session turns")
    m = run_worker("memory", {"artifact": str(args.small_artifact), "turns": args.memory_turns, "budget_mb": 4,
                              "requests": 60}, sys.executable, args.threads)
    rss, warm = m["rss_mb"], min(20, len(m["rss_mb"]) // 2)
    return {"rss_first_mb": rss[0], "rss_after_warmup_mb": rss[warm], "rss_last_mb": rss[-1],
            "rss_growth_after_warmup_mb": max(rss[warm:]) - rss[warm], "dropped_turns": m["dropped_turns"],
            "budget_bytes": m["budget_bytes"], "block_bytes": m["block_bytes"], "max_held_bytes": max(m["held_bytes"]),
            "peak_bytes": m["peak_bytes"], "evicted_blocks": m["evicted_blocks"]}


def report(res: dict) -> str:
    lines = []
    if "conversation" in res:
        c = res["conversation"]
        lines.append("turn | prompt tok | cached | " + " | ".join(f"{n} ttft ms" for n in c["ttft_ms"]))
        for k, (p, h) in enumerate(zip(c["prompt_tokens"], c["cached_tokens"])):
            lines.append(f"{k + 1} | {p} | {h} | " + " | ".join(f"{v[k]:.1f}" for v in c["ttft_ms"].values()))
        lines.append(f"last turn session / re-prefill: {c['turn_last_ratio']:.3f}x (goal <= 0.25); "
                     f"same tokens: {c['same_tokens']}")
    if "shared" in res:
        s = res["shared"]
        lines.append(f"shared prompt ({s['prompt_tokens']} tok/request): cache {s['wall_s']['cache']:.2f} s, no cache "
                     f"{s['wall_s']['no cache']:.2f} s = {s['ratio']:.3f}x (goal <= 0.5); cached tokens "
                     f"{s['cached_tokens']}; same tokens: {s['same_tokens']}")
    if "memory" in res:
        m = res["memory"]
        lines.append(f"memory: RSS {m['rss_first_mb']:.0f} -> {m['rss_after_warmup_mb']:.0f} (warm) -> "
                     f"{m['rss_last_mb']:.0f} MB, growth after warm-up {m['rss_growth_after_warmup_mb']:.1f} MB; "
                     f"dropped turns {m['dropped_turns']}; cache held <= {m['max_held_bytes']} of "
                     f"{m['budget_bytes']} bytes (block {m['block_bytes']}), evicted {m['evicted_blocks']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifact", type=Path)
    p.add_argument("--small-artifact", type=Path, help="an export with a small max_seq for (c)")
    p.add_argument("--genai", type=Path, help="onnxruntime-genai model folder")
    p.add_argument("--genai-python", default="/work/genai-venv/bin/python")
    p.add_argument("--gguf", type=Path, help="GGUF for llama.cpp")
    p.add_argument("--llama-python", default=sys.executable)
    p.add_argument("--parts", type=lambda s: s.split(","), default=["conversation", "shared", "memory"])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reply", type=int, default=24)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--system-words", type=int, default=300, help="words of the shared system prompt (~400 tokens)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--memory-turns", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(WORKERS[job.pop("kind")](job)))
        return 0
    if args.artifact is None and set(args.parts) & {"conversation", "shared"}:
        raise SystemExit("bench/prefix.py: --artifact is needed for the conversation and shared parts")
    res: dict = {"threads": args.threads}
    if "conversation" in args.parts:
        res["conversation"] = conversation(args)
    if "shared" in args.parts:
        res["shared"] = shared_prompt(args)
    if "memory" in args.parts:
        if args.small_artifact is None:
            raise SystemExit("bench/prefix.py: --small-artifact is needed for the memory part")
        res["memory"] = memory(args)
    res["load_avg"] = os.getloadavg()
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
