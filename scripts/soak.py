"""Soak test: long runs through the API hold memory flat and leak no cache slots.

    python scripts/soak.py                      # SmolLM2-135M (exported once into $DECODERT_CACHE), CPU
    python scripts/soak.py --artifact OUT --tokens 2000 --requests 40 --json

Phase 1 streams and generates ``--tokens`` tokens (sampled, varied prompts, one request at a time)
and compares the resident set size after a warm-up pass over the same prompts with the RSS at the
end: growth must stay under ``--max-growth`` (5%). Phase 2 sends ``--rounds`` x ``--requests`` short
requests through continuous batching (``LLM.generate_many``, the artifact's max_batch slots) and
checks that every request finished, no slot is still held (``LLM.slots_in_use``), every cache
length is 0 after each round, and RSS after the last round is within 5% of RSS after the first
(the first round is the batched shapes' warm-up).
Prints a summary (``--json``: one JSON object); exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from decodert.runtime.llm import LLM, Request
from decodert.runtime.backends.memory import current_rss_bytes
from decodert.runtime.decoding.sampling import SamplingParams

PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Explain how a bicycle works, step by step.",
           "Write a poem about winter mornings in the city.", "List ten facts about the ocean and explain each.",
           "Describe a day in the life of a honeybee.", "What makes a good cup of coffee? Go into detail.",
           "Summarise the history of the printing press.", "Write a letter to a friend about a trip to the mountains."]


def _rss_mb() -> float:
    gc.collect()
    return (current_rss_bytes() or 0) / 2**20


def _one(llm: LLM, i: int, max_new: int, stream: bool) -> int:
    kw = dict(max_new_tokens=max_new, temperature=0.8, top_p=0.95, seed=i)
    prompt = PROMPTS[i % len(PROMPTS)]
    if stream:
        s = llm.stream(prompt, **kw)
        for _ in s:
            pass
        return len(s.result.token_ids) if s.result else 0
    return len(llm.generate(prompt, **kw).token_ids)


def tokens_phase(llm: LLM, target: int, max_new: int) -> dict:
    """Warm up over every prompt (generate and stream), then run until ``target`` tokens."""
    for i in range(len(PROMPTS)):
        _one(llm, i, max_new, stream=bool(i % 2))
    start, t0, done, i, samples = _rss_mb(), time.perf_counter(), 0, 0, []
    while done < target:
        done += _one(llm, 1000 + i, min(max_new, target - done), stream=bool(i % 2))
        i += 1
        samples.append(round(_rss_mb(), 1))
    end = _rss_mb()
    seconds = time.perf_counter() - t0
    return {"tokens": done, "requests": i, "seconds": round(seconds, 1), "tokens_per_s": round(done / seconds, 1),
            "rss_after_warmup_mb": round(start, 1), "rss_end_mb": round(end, 1), "rss_max_mb": max(samples),
            "rss_growth": round((end - start) / start, 4)}


def batching_phase(llm: LLM, n: int, rounds: int) -> dict:
    """``rounds`` x ``n`` short requests (4..40 tokens, prompts of varied length) through continuous batching;
    finished requests, slots held and cache lengths after each round, RSS after each round."""
    finished = tokens = 0
    rss, held, lengths, t0 = [round(_rss_mb(), 1)], [], [], time.perf_counter()
    for r in range(rounds):
        requests = [Request(PROMPTS[i % len(PROMPTS)] + " Be brief." * (i % 5),
                            SamplingParams(max_new_tokens=4 + (i * 7) % 37, temperature=0.7, seed=r * n + i))
                    for i in range(n)]
        results = llm.generate_many(requests)
        finished += sum(res.finish_reason in ("stop", "length") for res in results)
        tokens += sum(len(res.token_ids) for res in results)
        held.append(llm.slots_in_use)
        lengths.append([int(x) for x in llm.engine.cache.lengths] if llm.engine.cache is not None else [])
        rss.append(round(_rss_mb(), 1))
    return {"requests": n * rounds, "rounds": rounds, "finished": finished, "tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1), "slots": int(llm.backend.max_batch),
            "slots_in_use_after": held, "cache_lengths_after": lengths, "rss_before_and_after_rounds_mb": rss,
            "rss_growth_after_round_1": round((rss[-1] - rss[1]) / rss[1], 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="artifact folder (default: SmolLM2 exported once into the cache)")
    p.add_argument("--tokens", type=int, default=20_000, help="tokens in phase 1 (default 20000)")
    p.add_argument("--max-new-tokens", type=int, default=400, help="per request in phase 1 (default 400)")
    p.add_argument("--requests", type=int, default=200, help="requests per round in phase 2 (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of phase 2; RSS after round 1 must stay flat (default 3)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth after warm-up (default 0.05)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.artifact is None:
        from decodert.export.prepare import prepare_model

        args.artifact = prepare_model("smollm2")
    llm = LLM.load(args.artifact, backend="ort")
    report: dict = {"artifact": str(args.artifact)}
    if args.tokens:
        report["tokens_phase"] = tokens_phase(llm, args.tokens, args.max_new_tokens)
    b = report["batching_phase"] = batching_phase(llm, args.requests, args.rounds)
    report["ok"] = (report.get("tokens_phase", {}).get("rss_growth", 0) < args.max_growth
                    and b["finished"] == b["requests"] and not any(b["slots_in_use_after"])
                    and not any(map(any, b["cache_lengths_after"])) and b["rss_growth_after_round_1"] < args.max_growth)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
