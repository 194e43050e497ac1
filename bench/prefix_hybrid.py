"""Turn-N TTFT of a multi-turn chat on hybrid models with the prefix cache on and off (issue 33).

    python bench/prefix_hybrid.py --threads 2 [--models lfm2,qwen3_5] [--turns 6] [--repeats 3]
        [--reply 16] [--cache /tmp/prefix-hybrid-bench] [--json out.json]

A random-weight LFM2 (hidden 512, 12 layers, every third attention: bench/hybrid_lfm2.py's) and a random
Qwen3.5 text model (hidden 512, 8 layers, every fourth full attention, 8 DeltaNet heads of 64), both
exported for ONNX Runtime fp32 (max_seq 2048, max_batch 4). A conversation of ``--turns`` user turns of about 150
tokens after a system prompt of about 340 (a byte-level BPE trained on one sentence: a word is several
tokens), ``--reply`` greedy tokens per answer. Each turn the whole
history goes through ``llm.chat(history)``, as a stateless chat API serves it, on two LLMs over the same
artifact: the prefix cache on (its default budget) and off; a session (``llm.session()``, whose row
keeps K/V and states) is timed beside them for reference. The three run alternately within each turn,
over the same rendered history (the "off" answers), and their tokens are compared. The prefix cache
is emptied before each repeat. Then the last turn's prompt with the cache emptied first, against the
cache off (2 x ``--repeats``, alternated): what stopping at the boundaries costs a prompt that reuses
nothing. Last, 8 requests sharing a ~400-token system prompt through one ``generate_many`` over 4
slots, cache on (emptied first) vs off. Medians; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

WORDS = "the quick brown fox jumps over the lazy dog while a careful keeper lights the lamp at dusk".split()


def qwen35_checkpoint(folder: Path, tokenizer_from: Path) -> Path:
    """A random Qwen3.5 text model (seed 0) with the LFM2 bench checkpoint's tokenizer and chat template."""
    if (folder / "config.json").is_file():
        return folder
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=16384, hidden_size=512, intermediate_size=1792, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8, linear_num_value_heads=8,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def artifact(model: str, cache: Path) -> Path:
    from hybrid_lfm2 import checkpoint

    from decodert.export.pipeline import export_model

    lfm2 = checkpoint(cache / "hf-lfm2-512x12", 512, 12, 16384)
    src = lfm2 if model == "lfm2" else qwen35_checkpoint(cache / "hf-qwen3_5-512x8", lfm2)
    art = cache / f"ort-{model}-b4"
    if not (art / "manifest.json").is_file():
        export_model(src, art, target="ort", dtype="fp32", max_seq=2048, max_batch=4, progress=False)
    return art


def user_text(turn: int) -> str:
    return " ".join(WORDS[(turn * 3 + k) % len(WORDS)] for k in range(40))


def run(model: str, args: argparse.Namespace) -> list[dict]:
    from decodert.runtime.llm import LLM

    art = artifact(model, args.cache)
    on, off = LLM.load(art, backend="ort"), LLM.load(art, backend="ort", prefix_cache_mb=0)
    assert on.prefix_cache is not None
    system = "You are a careful assistant who answers about lighthouses. " * 4
    for llm in (on, off):
        llm.generate("Warm up.", max_new_tokens=2)
    rows: list[dict] = []
    for rep in range(args.repeats):
        on.prefix_cache.clear()
        session = off.session(system=system)
        history = [{"role": "system", "content": system}]
        for t in range(args.turns):
            history.append({"role": "user", "content": user_text(t)})
            r_off = off.chat(history, max_new_tokens=args.reply, temperature=0)
            r_on = on.chat(history, max_new_tokens=args.reply, temperature=0)
            r_ses = session.chat(user_text(t), max_new_tokens=args.reply, temperature=0)
            if r_on.token_ids != r_off.token_ids:
                raise SystemExit(f"{model} turn {t + 1}: the prefix cache changed the answer")
            history.append({"role": "assistant", "content": r_off.text})
            if rep == 0:
                rows.append({"turn": t + 1, "prompt": r_on.metrics.prompt_tokens, "cached": [], "on_ms": [],
                             "off_ms": [], "session_ms": [], "session_cached": []})
            row = rows[t]
            row["cached"].append(r_on.metrics.cached_tokens)
            row["on_ms"].append(r_on.metrics.ttft_s * 1000)
            row["off_ms"].append(r_off.metrics.ttft_s * 1000)
            row["session_ms"].append(r_ses.metrics.ttft_s * 1000)
            row["session_cached"].append(r_ses.metrics.cached_tokens)
    cold: dict[str, list[float]] = {"miss_ms": [], "off_ms": []}  # the last turn's prompt, the cache emptied first
    for _ in range(args.repeats * 2):  # what stopping at the boundaries costs a prompt that reuses nothing
        on.prefix_cache.clear()
        cold["miss_ms"].append(on.chat(history[:-1], max_new_tokens=1, temperature=0).metrics.ttft_s * 1000)
        cold["off_ms"].append(off.chat(history[:-1], max_new_tokens=1, temperature=0).metrics.ttft_s * 1000)
    rows.append({"turn": "miss", "prompt": rows[-1]["prompt"], **{k: statistics.median(v) for k, v in cold.items()}})
    stats = on.prefix_cache.stats
    print(f"  {model}: prefix cache budget {on.prefix_cache.budget_bytes / 2**20:.1f} MiB, peak "
          f"{stats.peak_bytes / 2**20:.1f} MiB, {stats.stored_states} states stored, block "
          f"{on.prefix_cache.block_bytes / 2**10:.0f} KiB, states per boundary "
          f"{sum(on._cache.state_bytes) / 2**10:.0f} KiB", flush=True)
    return [{k: (statistics.median(v) if isinstance(v, list) else v) for k, v in row.items()} for row in rows[:-1]] + rows[-1:]


def shared(model: str, args: argparse.Namespace) -> dict:
    """8 requests sharing a ~400-token system prompt through one ``generate_many`` (4 slots), cache on
    (emptied first) vs off, alternated: wall time, and the tokens each request loaded."""
    from decodert.runtime.decoding.sampling import SamplingParams
    from decodert.runtime.llm import LLM, Request

    art = artifact(model, args.cache)
    on, off = LLM.load(art, backend="ort"), LLM.load(art, backend="ort", prefix_cache_mb=0)
    system = "You answer questions about this story. " + "the keeper lit the lamp at dusk and watched the sea " * 8
    reqs = [Request(messages=[{"role": "system", "content": system},
                              {"role": "user", "content": f"Tell me about topic {i}, please."}],
                    params=SamplingParams(max_new_tokens=8, temperature=0)) for i in range(8)]
    out: dict = {"on_s": [], "off_s": []}
    for _ in range(args.repeats):
        assert on.prefix_cache is not None
        on.prefix_cache.clear()
        t0 = time.perf_counter()
        got = on.generate_many(reqs)
        out["on_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        want = off.generate_many(reqs)
        out["off_s"].append(time.perf_counter() - t0)
        if [r.token_ids for r in got] != [r.token_ids for r in want]:
            raise SystemExit(f"{model}: the prefix cache changed an answer")
    return {"on_s": statistics.median(out["on_s"]), "off_s": statistics.median(out["off_s"]),
            "prompt": got[0].metrics.prompt_tokens, "cached": [r.metrics.cached_tokens for r in got]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--models", default="lfm2,qwen3_5")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/prefix-hybrid-bench"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ["DECODERT_THREADS"] = str(args.threads)
    out = {"load_before": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for model in args.models.split(","):
        rows = run(model, args)
        out[model] = rows
        print(f"{model}: turn, prompt tokens, cached (prefix cache on), TTFT ms: cache on, cache off, session "
              "(its row held)")
        for r in rows[:-1]:
            print(f"  {r['turn']:2d} {r['prompt']:5d} {r['cached']:5.0f} {r['on_ms']:8.1f} {r['off_ms']:8.1f} "
                  f"{r['session_ms']:8.1f} ({r['session_cached']:.0f})", flush=True)
        miss = rows[-1]
        print(f"  the last prompt ({miss['prompt']} tokens) with nothing cached: {miss['miss_ms']:.1f} ms with the cache "
              f"(it stops at the boundaries and stores) vs {miss['off_ms']:.1f} ms without", flush=True)
    for model in args.models.split(","):
        sh = out[f"{model}_shared"] = shared(model, args)
        print(f"{model}: 8 requests sharing a system prompt ({sh['prompt']} prompt tokens each), generate_many over 4 "
              f"slots: {sh['on_s']:.2f} s with the cache (tokens loaded {sh['cached']}) vs {sh['off_s']:.2f} s without",
              flush=True)
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
