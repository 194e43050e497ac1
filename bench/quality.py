"""Quality of the quantized exports against fp32: perplexity on a fixed text and greedy agreement.

    python bench/quality.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work /tmp/decodert-compare]
                            [--tokens 128] [--json quality.json]

Exports (into ``--work``, kept between runs) fp32, int8 (accuracy level 0 and 4), int4 accuracy
level 0 and int4 accuracy level 4, then for each:

- perplexity over bench/fixed_text.txt, teacher-forced token by token: the prefill graph outputs
  only the last position's logits, so the first token is prefilled and every next token is fed
  through a decode step; the logits of each step score the token that follows.
- greedy agreement with fp32 over ``--tokens`` generated tokens: fp32 generates greedily from the
  text's first sentence; the quantized model is fed the same tokens (teacher forcing) and its
  argmax is compared at every step. The first position where its own free-running greedy output
  departs from fp32's is reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.export.pipeline import export_model
from decodert.export.checkpoints.source_precision import keep_precision
from decodert.export.quantize.quant import QuantConfig
from decodert.runtime.backends.loading import open_backend, open_tokenizer, read_manifest

from compare import DEFAULT_GGUF

TEXT = Path(__file__).with_name("fixed_text.txt")
VARIANTS = {
    "fp32": None,
    "int8": QuantConfig(bits=8),  # accuracy level 0 (fp32 compute): slow on ORT CPU, see docs/benchmarks/history.md ("Quality")
    "int8 acc4": QuantConfig(bits=8, accuracy_level=4),
    "int4 acc0": QuantConfig(bits=4, accuracy_level=0),
    "int4 acc4": QuantConfig(bits=4, accuracy_level=4),
    "int4 acc4 sym": QuantConfig(bits=4, accuracy_level=4, symmetric=True),  # onnxruntime-genai's int4 choice
    "int4 acc4 b64": QuantConfig(bits=4, block_size=64, accuracy_level=4),
    "int4 acc4 b128": QuantConfig(bits=4, block_size=128, accuracy_level=4),
    "int4 acc4 keep-q8": QuantConfig(bits=4, accuracy_level=4, keep_q8=True),  # Q8_0 head/embedding kept exact
    "int4 acc4 float head": QuantConfig(bits=4, accuracy_level=4, lm_head=False),
    "int4 acc4 keep-q4-1": QuantConfig(bits=4, accuracy_level=4, keep_q4_1=True),  # Q4_1 layers exact
    "int4 acc4 keep-q4-1 keep-q8": QuantConfig(bits=4, accuracy_level=4, keep_q4_1=True, keep_q8=True),  # all exact
    "run default": None,  # what `decodert run` exports from this GGUF (export/checkpoints/source_precision.py)
}


def load(gguf: Path, work: Path, label: str):
    folder = work / f"quality_{label.replace(' ', '_')}"
    if not (folder / "manifest.json").is_file():
        quant = VARIANTS[label]
        if label == "run default":
            with open_checkpoint(gguf) as ckpt:
                quant = keep_precision(ckpt)[0]
        export_model(gguf, folder, max_seq=512, max_batch=1, progress=False, quant=quant)
    manifest = read_manifest(folder)
    return open_backend(folder, manifest, "ort"), open_tokenizer(folder, manifest)


def perplexity(backend, ids: np.ndarray) -> float:
    """exp(mean NLL of ids[1:]) with one decode step per token (teacher forcing)."""
    cache = backend.allocate(1)
    logits = backend.prefill(cache, [0], [ids[:1]], want_logits=True).logits[0]
    nll = 0.0
    for t in range(1, len(ids)):
        nll -= _log_softmax(logits)[ids[t]]
        if t + 1 < len(ids):
            logits = backend.decode(cache, [0], ids[t : t + 1], want_logits=True).logits[0]
    return math.exp(nll / (len(ids) - 1))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def greedy(backend, prompt: np.ndarray, n: int) -> np.ndarray:
    cache = backend.allocate(1)
    token = backend.prefill(cache, [0], [prompt], want_logits=False).next_token
    out = [int(token[0])]
    for _ in range(n - 1):
        token = backend.decode(cache, [0], token, want_logits=False).next_token
        out.append(int(token[0]))
    return np.array(out, np.int64)


def forced_agreement(backend, prompt: np.ndarray, reference: np.ndarray) -> float:
    """Share of steps where the model's argmax equals ``reference`` when fed the reference tokens."""
    cache = backend.allocate(1)
    agree = int(backend.prefill(cache, [0], [prompt], want_logits=False).next_token[0] == reference[0])
    for t in range(1, len(reference)):
        got = backend.decode(cache, [0], reference[t - 1 : t], want_logits=False).next_token[0]
        agree += int(got == reference[t])
    return agree / len(reference)


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.nonzero(a != b)[0]
    return int(diff[0]) if diff.size else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-compare"))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of: {', '.join(VARIANTS)} (fp32 first: the reference)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    labels = [v.strip() for v in args.variants.split(",")]
    if labels[0] != "fp32" or not set(labels) <= set(VARIANTS):
        p.error(f"--variants must start with fp32 and name only: {', '.join(VARIANTS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    text = TEXT.read_text()
    rows, reference = [], None
    for label in labels:
        backend, tokenizer = load(args.gguf, args.work, label)
        ids = np.array(tokenizer.encode(text).ids, np.int64)
        prompt = np.array(tokenizer.encode(text.split(". ")[0] + ".").ids, np.int64)
        tokens = greedy(backend, prompt, args.tokens)
        reference = tokens if reference is None else reference
        row = {"variant": label, "ppl": perplexity(backend, ids), "text_tokens": len(ids),
               "forced_agreement": forced_agreement(backend, prompt, reference),
               "first_divergence": first_divergence(tokens, reference), "weights_mb": _weights_mb(backend)}
        rows.append(row)
        div = "none" if row["first_divergence"] is None else row["first_divergence"]
        print(f"{label:<10} ppl {row['ppl']:7.3f} ({len(ids)} tokens) | greedy agreement with fp32 "
              f"{row['forced_agreement'] * 100:5.1f}% of {args.tokens} (teacher-forced), free-running first "
              f"divergence at {div} | weights.bin {row['weights_mb']:.0f} MB", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _weights_mb(backend) -> float:
    return (backend.manifest.weights.bytes or 0) / 1e6


if __name__ == "__main__":
    sys.exit(main())
