"""Soak test: long runs through the API hold memory flat and leak no cache slots.

    python scripts/soak.py                      # SmolLM2-135M (exported once into $DECODERT_CACHE), CPU
    python scripts/soak.py --artifact OUT --tokens 2000 --requests 40 --json

Phase 1 streams and generates ``--tokens`` tokens (sampled, varied prompts, one request at a time)
and compares the resident set size after a warm-up pass over the same prompts with the RSS at the
end: growth must stay under ``--max-growth`` (5%). Phase 2 sends ``--requests`` short requests
through continuous batching (``LLM.generate_many``, the artifact's max_batch slots) and checks that
every request finished, no slot is still held (``LLM.slots_in_use``) and every cache length is 0.
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
from decodert.runtime.memory import current_rss_bytes
from decodert.runtime.sampling import SamplingParams

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


def batching_phase(llm: LLM, n: int) -> dict:
    """``n`` short requests (4..40 tokens) through continuous batching; slots and cache lengths after."""
    requests = [Request(PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=4 + (i * 7) % 37, temperature=0.7,
                                                                  seed=i)) for i in range(n)]
    before, t0 = _rss_mb(), time.perf_counter()
    results = llm.generate_many(requests)
    lengths = [int(x) for x in llm._cache.lengths] if llm._cache is not None else []
    return {"requests": n, "finished": sum(r.finish_reason in ("stop", "length") for r in results),
            "tokens": sum(len(r.token_ids) for r in results), "seconds": round(time.perf_counter() - t0, 1),
            "slots": int(llm.backend.max_batch), "slots_in_use_after": llm.slots_in_use,
            "cache_lengths_after": lengths, "rss_before_mb": round(before, 1), "rss_after_mb": round(_rss_mb(), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="artifact folder (default: SmolLM2 exported once into the cache)")
    p.add_argument("--tokens", type=int, default=20_000, help="tokens in phase 1 (default 20000)")
    p.add_argument("--max-new-tokens", type=int, default=400, help="per request in phase 1 (default 400)")
    p.add_argument("--requests", type=int, default=200, help="requests in phase 2 (default 200)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth after warm-up (default 0.05)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.artifact is None:
        from decodert.runtime.cli_run import prepare_model

        args.artifact = prepare_model("smollm2")
    llm = LLM.load(args.artifact, backend="ort")
    report = {"artifact": str(args.artifact), "tokens_phase": tokens_phase(llm, args.tokens, args.max_new_tokens),
              "batching_phase": batching_phase(llm, args.requests)}
    b = report["batching_phase"]
    report["ok"] = (report["tokens_phase"]["rss_growth"] < args.max_growth and b["finished"] == args.requests
                    and b["slots_in_use_after"] == 0 and not any(b["cache_lengths_after"]))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
