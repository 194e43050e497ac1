"""The prefix cache's disk tier (issue 48): a restarted `decodert serve --cache-dir` on a ~2,000-token system prompt.

    python bench/prefix_disk.py [--model ~/.cache/decodert/models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                [--work /tmp/decodert-prefix-disk] [--rounds 3] [--json out.json]

Each round, with an emptied cache folder:
1. cold: starts ``decodert serve MODEL --cache-dir DIR``, sends one short warm-up request (ONNX Runtime's first
   run), then the measured chat request: a system prompt of about 2,000 tokens and a question, greedy, streamed with
   usage; TTFT is request sent -> first content chunk. SIGTERM: the server writes what its disk tier queued.
2. warm from disk: a new server on the same folder, the same warm-up, the same request: TTFT, usage's
   cached_tokens of prompt_tokens, and the answer compared with the cold one.
The warm-up prompt shares nothing with the measured one (it cannot warm its blocks). Medians over the rounds;
cold and warm alternate within each round. Goals (issue 48): cached >= 90% of the prompt, TTFT <= 0.2x the cold.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "In two sentences: what is this manual about?"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def system_prompt(words: int) -> str:
    """A system prompt of ``words`` words: the bench's fixed text, numbered paragraphs (no two blocks alike)."""
    base = (ROOT / "bench" / "fixed_text.txt").read_text().split()
    out, k = [], 0
    while sum(len(p.split()) for p in out) < words:
        out.append(f"Section {k + 1}. " + " ".join(base[(k * 37) % len(base):] + base[: (k * 37) % len(base)])[:600])
        k += 1
    return "You are the assistant of this operations manual. Answer from it only.\n\n" + "\n\n".join(out)


def start(model: str, cache_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "decodert", "serve", model, "--port", "0", "--model-name", "m",
                             "--cache-dir", str(cache_dir)], stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return proc, found.group(1)
    raise SystemExit(f"decodert serve did not start (exit {proc.wait()})")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(120) != 0:
        raise SystemExit(f"decodert serve exited {proc.returncode}")


def ask(url: str, system: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat request -> {ttft_s, text, prompt_tokens, cached_tokens}."""
    import httpx

    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - t0
                text += delta
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "text": text, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def one_life(model: str, cache_dir: Path, system: str, max_tokens: int) -> dict:
    proc, url = start(model, cache_dir)
    try:
        ask(url, "You are brief.", "Say hello.", 4)  # warm-up: ORT's first run, nothing shared with the prompt
        return ask(url, system, QUESTION, max_tokens)
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/decodert/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/decodert-prefix-disk"))
    ap.add_argument("--words", type=int, default=1600, help="system prompt words (1,600: about 2,000 SmolLM2 tokens)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    system = system_prompt(args.words)
    cache_dir = args.work / "cache"
    rows = []
    for k in range(args.rounds):
        shutil.rmtree(cache_dir, ignore_errors=True)
        cold = one_life(args.model, cache_dir, system, args.max_tokens)
        files = list(cache_dir.glob("*/*.blk"))
        warm = one_life(args.model, cache_dir, system, args.max_tokens)
        rows.append({"cold": cold, "warm": warm, "files": len(files)})
        log(f"round {k + 1}: prompt {warm['prompt_tokens']} tokens, cached {warm['cached_tokens']}, TTFT cold "
            f"{cold['ttft_s'] * 1000:.0f} ms, warm from disk {warm['ttft_s'] * 1000:.0f} ms, {len(files)} block files, "
            f"same answer: {warm['text'] == cold['text']}")
    cold_ms = statistics.median(r["cold"]["ttft_s"] for r in rows) * 1000
    warm_ms = statistics.median(r["warm"]["ttft_s"] for r in rows) * 1000
    prompt = rows[0]["warm"]["prompt_tokens"]
    cached = statistics.median(r["warm"]["cached_tokens"] for r in rows)
    same = all(r["warm"]["text"] == r["cold"]["text"] for r in rows)
    print(f"prompt tokens            {prompt}")
    print(f"cached tokens (warm)     {cached:.0f}  ({100 * cached / prompt:.1f}% of the prompt; goal >= 90%)")
    print(f"TTFT cold                {cold_ms:.0f} ms  (median of {len(rows)})")
    print(f"TTFT warm from disk      {warm_ms:.0f} ms  ({warm_ms / cold_ms:.3f}x the cold; goal <= 0.2x)")
    print(f"same tokens as cold      {same}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows, "cold_ms": cold_ms, "warm_ms": warm_ms, "prompt_tokens": prompt,
                                         "cached_tokens": cached, "same": same}, indent=1))


if __name__ == "__main__":
    main()
