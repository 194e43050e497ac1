"""The KV cache's element type (``--kv-dtype``) on SmolLM2-135M: quality, decode speed, memory, context.

    python bench/kv_dtype.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work /tmp/decodert-kv]
                             [--kv fp32,fp16,int8,int4] [--threads 2] [--repeats 3] [--json kv.json]

Exports the GGUF as `decodert run` does (fp32 weights, ort target, max_seq 2048, batch 4) once per KV dtype
(into ``--work``, kept between runs), then per dtype:

- perplexity over bench/fixed_text.txt (the figure docs/benchmarks/history.md ("Quality") quotes for the weights, 34.0 at fp32)
  and over the first ``--long`` tokens of README.md, teacher-forced one decode step per token
  (bench/quality.py's method): the cache holds every earlier token in the KV dtype;
- greedy agreement with the fp32 cache on ``PROMPTS`` (32 tokens each): identical free-running answers, and
  the share of teacher-forced steps whose argmax equals fp32's;
- decode tok/s at batch 1 and 4 after a ``--context``-token prompt per row (the cache read grows with the
  context), ``--steps`` steps, the dtypes alternated and rotated ``--repeats`` times (bench/rotation.py),
  the median reported; ONNX Runtime with ``--threads`` intra-op threads;
- KV bytes per token, the cache at max_seq x batch, and the long-context row: the longest context whose
  cache fits ``--budget-mib`` for one sequence (runtime/backends/memory.kv_cache_bytes, the estimate the
  backends check before allocating), beside the model's own limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from decodert.export.pipeline import export_model
from decodert.plugins.ops.kv_dtypes import KV_DTYPES
from decodert.runtime.backends.loading import open_tokenizer, read_manifest
from decodert.runtime.backends.memory import kv_cache_bytes
from decodert.runtime.backends.ort.backend import OrtBackend

from compare import DEFAULT_GGUF
from quality import forced_agreement, greedy, perplexity
from rotation import rotate

ROOT = Path(__file__).resolve().parent
PROMPTS = ["The capital of France is", "Write a short poem about the sea and the wind.", "def fib(n):",
           "Once upon a time, in a small village by the sea,", "The three primary colors are",
           "Explain in one sentence what a compiler does."]


def load(gguf: Path, work: Path, kv: str, threads: int) -> tuple[OrtBackend, object]:
    folder = work / f"kv_{kv}"
    if not (folder / "manifest.json").is_file():
        export_model(gguf, folder, max_seq=2048, max_batch=4, progress=False, kv_dtype=kv)
    manifest = read_manifest(folder)
    return OrtBackend(folder, manifest, threads=threads), open_tokenizer(folder, manifest)


def decode_tps(backend: OrtBackend, context: np.ndarray, batch: int, steps: int) -> float:
    """Tokens per second of ``steps`` decode steps over ``batch`` rows that each hold ``context``."""
    cache = backend.allocate(batch)
    slots = list(range(batch))
    for s in slots:
        backend.prefill(cache, [s], [context], want_logits=False)
    token = np.full(batch, int(context[-1]), np.int64)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = backend.decode(cache, slots, token, want_logits=False).next_token.copy()
    return batch * steps / (time.perf_counter() - t0)


def quality(backend: OrtBackend, tok, ref: dict | None, long_tokens: int) -> dict:
    text = (ROOT / "fixed_text.txt").read_text()
    long_ids = np.array(tok.encode((ROOT.parent / "README.md").read_text()).ids[:long_tokens], np.int64)
    answers = [greedy(backend, np.array(tok.encode(p).ids, np.int64), 32) for p in PROMPTS]
    row = {"ppl": perplexity(backend, np.array(tok.encode(text).ids, np.int64)),
           "ppl_long": perplexity(backend, long_ids), "answers": [a.tolist() for a in answers]}
    if ref is not None:
        row["identical_answers"] = sum(a.tolist() == r for a, r in zip(answers, ref["answers"]))
        row["forced_agreement"] = statistics.mean(
            forced_agreement(backend, np.array(tok.encode(p).ids, np.int64), np.array(r, np.int64))
            for p, r in zip(PROMPTS, ref["answers"]))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-kv"))
    p.add_argument("--kv", default="fp32,fp16,int8,int4", help="KV dtypes, fp32 first (the reference)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=1024, help="tokens per row before the timed decode steps")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--long", type=int, default=1024, help="README.md tokens for the long perplexity")
    p.add_argument("--budget-mib", type=float, default=256.0, help="KV memory of the long-context row")
    p.add_argument("--speed-only", action="store_true", help="skip the perplexity and greedy runs")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    kvs = [k.strip() for k in args.kv.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    loaded = {kv: load(args.gguf, args.work, kv, args.threads) for kv in kvs}
    rows: dict[str, dict] = {}
    for kv in kvs:
        backend, tok = loaded[kv]
        rows[kv] = {} if args.speed_only else quality(backend, tok, rows.get(kvs[0]), args.long)
        spec = backend.manifest.model.spec()
        per_token = kv_cache_bytes(1, 1, spec.num_layers, spec.num_kv_heads, spec.head_dim, KV_DTYPES[kv])
        rows[kv].update(kv_bytes_per_token=per_token, cache_mib=backend.kv_bytes(2048) * 4 / 2**20,
                        max_context_in_budget=int(args.budget_mib * 2**20 // per_token),
                        model_context=spec.max_position)
        if not args.speed_only:
            print(f"{kv:<5} ppl {rows[kv]['ppl']:.3f} (long {rows[kv]['ppl_long']:.3f}) "
                  f"identical {rows[kv].get('identical_answers', len(PROMPTS))}/{len(PROMPTS)} "
                  f"forced {rows[kv].get('forced_agreement', 1.0) * 100:.1f}% | {per_token} B/token", flush=True)
    context = np.array(loaded[kvs[0]][1].encode((ROOT.parent / "README.md").read_text()).ids[: args.context], np.int64)
    jobs = [(kv, b) for b in (1, 4) for kv in kvs]
    runs = rotate([list(range(len(jobs)))], args.repeats,
                  lambda i: decode_tps(loaded[jobs[i][0]][0], context, jobs[i][1], args.steps),
                  lambda s: print(s, file=sys.stderr, flush=True))
    for i, (kv, b) in enumerate(jobs):
        rows[kv][f"decode_tps_b{b}"] = statistics.median(runs[i])
    print(f"\nload {os.getloadavg()[0]:.2f}, {args.threads} threads, context {len(context)}, budget {args.budget_mib} MiB")
    print("| KV dtype | ppl fixed text | ppl README 1k | identical greedy | teacher-forced agreement | "
          "decode tok/s b1 | b4 | KV bytes/token | cache 2048x4 (MiB) | context in budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kv, r in rows.items():
        quality_cells = ("- | - | - | -" if args.speed_only else
                         f"{r['ppl']:.3f} | {r['ppl_long']:.3f} | {r.get('identical_answers', len(PROMPTS))}/{len(PROMPTS)} | "
                         f"{r.get('forced_agreement', 1.0) * 100:.1f}%")
        print(f"| {kv} | {quality_cells} | {r['decode_tps_b1']:.1f} | {r['decode_tps_b4']:.1f} | "
              f"{r['kv_bytes_per_token']} | {r['cache_mib']:.0f} | {r['max_context_in_budget']} "
              f"(model: {r['model_context']}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
