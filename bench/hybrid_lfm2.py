"""What a hybrid model's state costs on the CPU (issue 33): an LFM2 at random weights, ONNX Runtime fp32.

    python bench/hybrid_lfm2.py --threads 2 [--hidden 1024 --layers 16 --repeats 5 --cache /tmp/lfm2-bench]

1. Speculation's rewind (docs/SPECULATIVE.md, "Hybrid models"): a decode step, a verify pass of 6
   tokens, and what a row that rejected a draft pays on top, by either design: the replay (restore the
   snapshot + prefill of the j accepted tokens, j = 1, 3, 5), or taking the states after 3 tokens from
   the pass's conv windows (what decodert does for a model whose states are all conv states).
2. Sessions: turn-N time to first token through a session (its row keeps K/V and conv states, only
   the new turn is prefilled) against prefilling the whole conversation again (what a prefix cache
   could at best save; hybrids have none).
Every timing is the median of --repeats, alternated between the compared runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def checkpoint(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random LFM2 (every third layer attention, as LFM2-350M's 6 of 16) with a byte-level BPE tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, Lfm2Config

    kinds = ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]
    config = Lfm2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 4.5),
                        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                        layer_types=kinds, conv_L_cache=3, max_position_embeddings=4096)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 8], trainer)
    tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab - tok.get_vocab_size())])
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return folder


def _ms(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def rewind_costs(art: Path, threads: int, repeats: int, context: int) -> dict:
    from decodert.artifact.manifest import load_manifest
    from decodert.runtime.backends.ort.backend import OrtBackend

    be = OrtBackend(art, load_manifest(art), threads=threads)
    cache = be.allocate(1)
    rng = np.random.default_rng(0)
    be.prefill(cache, [0], [rng.integers(3, be.vocab_size, context)], want_logits=False)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):  # one round: each measurement once, from the same row state
        cache.snapshot(0)
        n = int(cache.lengths[0])
        runs = {"decode step": lambda: be.decode(cache, [0], rng.integers(3, be.vocab_size, 1), want_logits=False),
                "verify 6 tokens": lambda: be.verify(cache, [0], [rng.integers(3, be.vocab_size, 6)], want_logits=False),
                "snapshot": lambda: cache.snapshot(0)}
        for j in (1, 3, 5):
            runs[f"replay {j}"] = lambda j=j: (cache.rewind(0, n), be.prefill(cache, [0], [rng.integers(3, be.vocab_size, j)],
                                                                                 want_logits=False))
        runs["take 3 from windows"] = lambda: None  # timed below, after an untimed pass
        for name, fn in runs.items():
            if name == "take 3 from windows":
                out = be.verify(cache, [0], [rng.integers(3, be.vocab_size, 6)], want_logits=False)
                if out.windows is None:
                    continue
                keep = {state: w[:, 3 : 3 + w.shape[1] - 6] for state, w in out.windows[0].items()}
                fn = lambda keep=keep: cache.rewind(0, n + 3, keep)  # noqa: E731
            times.setdefault(name, []).extend(_ms(fn, 1))
            cache.rewind(0, cache.rewind_point(0, n))  # back to the snapshot for the next run
            cache.snapshot(0)
    return {name: statistics.median(v) for name, v in times.items()}


def session_ttft(art: Path, threads: int, repeats: int, turns: int) -> list[dict]:
    import os

    os.environ["DECODERT_THREADS"] = str(threads)
    from decodert.runtime.llm import LLM

    llm = LLM.load(art, backend="ort")
    words = "the quick brown fox jumps over the lazy dog".split()
    rows = []
    for rep in range(repeats):
        session = llm.session(system="You are a careful assistant. " * 20)
        for t in range(turns):
            text = " ".join(words[(t + k) % len(words)] for k in range(120))
            r = session.chat(text, max_new_tokens=16)
            history = llm.prepare(session.history[:-1], chat=True).ids
            full = llm.generate(history, max_new_tokens=16)  # the whole conversation prefilled again
            if rep == 0:
                rows.append({"turn": t + 1, "prompt": int(r.metrics.prompt_tokens), "cached": int(r.metrics.cached_tokens),
                             "session_ms": [], "reprefill_ms": []})
            rows[t]["session_ms"].append(r.metrics.ttft_s * 1000)
            rows[t]["reprefill_ms"].append(full.metrics.ttft_s * 1000)
    return [{**row, "session_ms": statistics.median(row["session_ms"]), "reprefill_ms": statistics.median(row["reprefill_ms"])}
            for row in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/lfm2-bench"))
    args = ap.parse_args(argv)
    from decodert.export.pipeline import export_model

    src = checkpoint(args.cache / f"hf-{args.hidden}x{args.layers}", args.hidden, args.layers, args.vocab)
    art = args.cache / f"ort-{args.hidden}x{args.layers}"
    if not (art / "manifest.json").is_file():
        export_model(src, art, target="ort", dtype="fp32", max_seq=4096, max_batch=1, progress=False)
    costs = rewind_costs(art, args.threads, args.repeats, args.context)
    print(f"LFM2 random {args.hidden}x{args.layers}, ort fp32, {args.threads} threads, context {args.context}")
    for name, ms in costs.items():
        print(f"  {name:16s} {ms:8.2f} ms")
    print("session turn-N TTFT (ms): turn, prompt tokens (of which the session's row held), session, "
          "whole conversation prefilled again")
    for row in session_ttft(art, args.threads, args.repeats, args.turns):
        print(f"  {row['turn']:2d} {row['prompt']:5d} ({row['cached']:4d}) {row['session_ms']:8.1f} {row['reprefill_ms']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
