"""Whisper speed (issue 50): real-time factor of a Whisper-small-shaped random checkpoint on decodert (ort backend,
fp32: encoder.onnx + decoder.onnx) beside transformers' WhisperForConditionalGeneration in torch (fp32, eager),
both on the same ``--threads`` CPU threads, transcribing the same speech-like clip to the same greedy tokens.

    python bench/whisper.py [--seconds 20] [--tokens 48] [--threads 2] [--repeats 3] [--depth-frac 1]
                            [--work /tmp/whisper-bench] [--json out.json]

Shape: Whisper-small (d_model 768, 12 encoder and 12 decoder layers, 12 heads, FFN 3072, 80 mels, 1500 encoder
rows, 448 decoder positions, vocab 51865, proj_out tied; weights random at scale 0.02); the tokenizer is tests/helpers/tiny_whisper.py's padded
to the vocabulary (its special tokens where the tiny one has them). ``--depth-frac`` scales both depths. Per repeat,
a fresh clip (nothing cached), forced language (<|en|>): wall time of ``LLM.transcribe`` (log-mel, encoder, cross
K/V, prompt, ``--tokens`` greedy tokens) and of WhisperFeatureExtractor + ``generate`` (the ids checked equal).
RTF = seconds / clip seconds (< 1: faster than real time). Medians over ``--repeats``, the two alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SMALL = dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12, decoder_attention_heads=12,
             encoder_ffn_dim=3072, decoder_ffn_dim=3072, max_target_positions=448, tie_word_embeddings=True)
VOCAB = 51865


def make_checkpoint(path: Path, depth_frac: float) -> Path:
    sys.path[:0] = [str(HERE / "tests" / "helpers")]
    import tiny_whisper as t

    shape = dict(SMALL, vocab_size=VOCAB)
    for k in ("encoder_layers", "decoder_layers"):
        shape[k] = max(1, round(shape[k] * depth_frac))
    make = t.make_tokenizer

    def padded(*args, **kwargs):  # tiny_whisper's make_tokenizer, padded to the real vocabulary
        tok = make(*args, **kwargs)
        tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
        return tok

    t.make_tokenizer = padded
    try:
        return t.make_tiny_whisper(path, noise=0.02, **shape)  # HF's init scale: fp32 logits well apart
    finally:
        t.make_tokenizer = make


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth-frac", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/whisper-bench"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import numpy as np
    import torch
    import transformers

    sys.path[:0] = [str(HERE / "tests" / "helpers")]
    from tiny_qwen3_asr import speech_like
    from tiny_whisper import reference_extractor

    from decodert.export.pipeline import export_model
    from decodert.runtime.audio.whisper import WhisperLLM

    torch.set_num_threads(args.threads)
    hf, art = args.work / f"hf-{args.depth_frac}", args.work / f"art-{args.depth_frac}"
    if not (hf / "config.json").is_file():
        make_checkpoint(hf, args.depth_frac)
    if not (art / "seq2seq.json").is_file():
        t0 = time.perf_counter()
        export_model(hf, art, progress=False)
        print(f"export {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    llm = WhisperLLM(art, threads=args.threads)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf).eval()
    fe = reference_extractor()
    ours, theirs = [], []
    for r in range(args.repeats):
        x = speech_like(args.seconds, 100 + r)
        t0 = time.perf_counter()
        got = llm.transcribe(x, sample_rate=16000, language="en", max_new_tokens=args.tokens)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            f = fe(x, sampling_rate=16000, return_tensors="pt")
            want = model.generate(f.input_features, language="en", max_new_tokens=args.tokens)[0].tolist()
        theirs.append(time.perf_counter() - t0)
        want = [i for i in want if i != model.generation_config.eos_token_id]
        if got.token_ids != want:
            print(f"repeat {r}: the ids differ ({len(got.token_ids)} vs {len(want)})", file=sys.stderr)
            return 1
    row = {"shape": "whisper-small" + ("" if args.depth_frac == 1 else f" x{args.depth_frac} depth"),
           "clip_s": args.seconds, "tokens": len(got.token_ids), "threads": args.threads,
           "decodert_s": statistics.median(ours), "torch_s": statistics.median(theirs),
           "decodert_rtf": statistics.median(ours) / args.seconds, "torch_rtf": statistics.median(theirs) / args.seconds,
           "decodert_encode_s": llm.model.encode_seconds, "runs": {"decodert": ours, "torch": theirs}}
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    return 0 if np.isfinite(row["decodert_s"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
