"""Structured output against llama.cpp's JSON-schema grammar, on the same schemas and model.

    python bench/structured_llama.py ART GGUF --llama-python /work/llama-venv/bin/python [--rounds 2]

ART is a decodert artifact exported from GGUF; llama.cpp (llama-cpp-python, run in its own
interpreter as a worker process) loads GGUF itself and constrains with
``LlamaGrammar.from_json_schema``. Every schema of tests/helpers/structured_schemas.py runs greedy and
sampled (temperature 0.9, seed = schema index) at batch 1, with the same prompt tokens (decodert's
chat template rendering, handed to llama.cpp's ``create_completion`` as ids: its
``create_chat_completion`` segfaults in llama-cpp-python 0.3.36 on this machine, with or without a
grammar) and max_new_tokens. Rounds alternate which contender goes first. An output is valid
when it ``json.loads`` and validates with ``jsonschema``; tok/s is completion tokens over the wall
time of the call (prefill included), summed over all calls of a round; the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, sys, time
from llama_cpp import Llama, LlamaGrammar
sys.path.insert(0, sys.argv[3])
from llama_workaround import disable_extra_buffer_types
disable_extra_buffer_types()
llm = Llama(model_path=sys.argv[1], n_ctx=1024, n_threads=int(sys.argv[2]), verbose=False, seed=0)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    r = json.loads(line)
    grammar = LlamaGrammar.from_json_schema(json.dumps(r["schema"]), verbose=False)
    t0 = time.perf_counter()
    out = llm.create_completion(r["prompt_ids"], grammar=grammar, max_tokens=r["max_new_tokens"],
                                temperature=r["temperature"], seed=r["seed"])
    dt = time.perf_counter() - t0
    print(json.dumps({"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"],
                      "finish": out["choices"][0]["finish_reason"], "s": dt}), flush=True)
"""


def requests(max_new_tokens: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))
    from structured_schemas import SCHEMAS

    return [{"name": name, "schema": schema, "temperature": t, "seed": i, "max_new_tokens": max_new_tokens,
             "messages": [{"role": "user", "content": "Reply with JSON for this schema: " + json.dumps(schema)}]}
            for t in (0.0, 0.9) for i, (name, schema) in enumerate(SCHEMAS)]


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_decodert(llm, reqs: list[dict]) -> list[dict]:
    out = []
    for r in reqs:
        t0 = time.perf_counter()
        g = llm.chat(r["messages"], json_schema=r["schema"], max_new_tokens=r["max_new_tokens"],
                     temperature=r["temperature"], seed=r["seed"])
        out.append({"text": g.text, "tokens": len(g.token_ids), "finish": g.finish_reason, "s": time.perf_counter() - t0})
    return out


def run_llama(proc, llm, reqs: list[dict]) -> list[dict]:
    out = []
    for r in reqs:
        job = {k: r[k] for k in ("schema", "max_new_tokens", "temperature", "seed")}
        job["prompt_ids"] = [int(t) for t in llm.prepare(r["messages"], chat=True).ids]  # the same prompt tokens as decodert's
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        out.append(json.loads(proc.stdout.readline()))
    return out


def summarise(name: str, reqs: list[dict], results: list[list[dict]]) -> dict:
    last = results[-1]
    ok = {t: sum(valid(o["text"], r["schema"]) for r, o in zip(reqs, last) if r["temperature"] == t) for t in (0.0, 0.9)}
    n = {t: sum(r["temperature"] == t for r in reqs) for t in (0.0, 0.9)}
    tps = [sum(o["tokens"] for o in res) / sum(o["s"] for o in res) for res in results]
    bad = [f"{r['name']}@{r['temperature']}" for r, o in zip(reqs, last) if not valid(o["text"], r["schema"])]
    return {"contender": name, "greedy_valid": f"{ok[0.0]}/{n[0.0]}", "sampled_valid": f"{ok[0.9]}/{n[0.9]}",
            "tok_s": round(statistics.median(tps), 1), "tok_s_rounds": [round(x, 1) for x in tps],
            "tokens": sum(o["tokens"] for o in last), "length_cut": sum(o["finish"] == "length" for o in last),
            "invalid": bad}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("gguf")
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    from decodert.runtime.llm import LLM

    llm = LLM.load(args.artifact)
    bench_dir = str(Path(__file__).resolve().parent)  # where the worker finds llama_workaround
    proc = subprocess.Popen([args.llama_python, "-c", WORKER, args.gguf, str(args.threads), bench_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["ready"]
    reqs = requests(args.max_new_tokens)
    results = {"decodert": [], "llama.cpp": []}
    for i in range(args.rounds):
        order = ["decodert", "llama.cpp"] if i % 2 == 0 else ["llama.cpp", "decodert"]
        for who in order:
            res = run_decodert(llm, reqs) if who == "decodert" else run_llama(proc, llm, reqs)
            results[who].append(res)
            print(f"round {i} {who}: {sum(o['tokens'] for o in res)} tokens in {sum(o['s'] for o in res):.1f} s", flush=True)
    proc.stdin.close()
    proc.wait()
    for who, res in results.items():
        print(json.dumps(summarise(who, reqs, res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
