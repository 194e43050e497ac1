"""Speech recognition speed (issue 50): real-time factor of a Qwen3-ASR-0.6B-shaped random checkpoint on decodert
(ort backend, fp32) beside transformers' Qwen3ASRForConditionalGeneration in torch (fp32, eager), both on the
same ``--threads`` CPU threads, transcribing the same speech-like clip to the same greedy tokens.

    python bench/audio.py [--seconds 10] [--tokens 48] [--threads 2] [--repeats 3] [--depth-frac 1]
                          [--work /tmp/audio-bench] [--json out.json]

Shape (an assumption where the released config is not at hand here: Qwen3-ASR-0.6B's AuT encoder as 18 layers
of d_model 896, 14 heads, FFN 3584, conv channels 480, 128 mels, n_window 50, n_window_infer 800; output 1024 into
Qwen3-0.6B: 28 layers of 1024, 16 heads / 8 KV heads of 128, MLP 3072, vocab 151936, tied). ``--depth-frac``
scales both depths (a shared machine: 0.25 exports in a minute). Per repeat, a fresh clip (nothing cached):
- encode: log-mel + audio.onnx (decodert: ``Audio.entry``; torch: ``get_audio_features`` on the extractor's
  features, extractor included);
- transcribe: wall time of ``LLM.transcribe`` / processor + ``generate`` for ``--tokens`` new tokens (forced
  language, so no language tokens; the same ids come out of both: checked);
RTF = transcribe seconds / clip seconds (lower is faster; < 1 is faster than real time). Medians over
``--repeats``, the two runtimes alternated within each repeat.
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
AUDIO = dict(num_mel_bins=128, encoder_layers=18, encoder_attention_heads=14, encoder_ffn_dim=3584, d_model=896,
             n_window=50, n_window_infer=800, downsample_hidden_size=480, output_dim=1024, max_position_embeddings=13)
TEXT = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
            rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def make_checkpoint(path: Path, depth_frac: float) -> Path:
    """A random Qwen3-ASR-0.6B-shaped checkpoint (depths x ``depth_frac``) with tests/helpers/tiny_qwen3_asr.py's
    tokenizer layout, padded to the real vocabulary."""
    import torch
    import transformers

    sys.path.insert(0, str(HERE / "tests" / "helpers"))
    import tiny_qwen3_asr as t

    if (path / "config.json").is_file():
        return path
    tok = t.make_tokenizer()
    tok.add_tokens([f"<|pad_{i}|>" for i in range(TEXT["vocab_size"] - tok.get_vocab_size())])
    audio = {**AUDIO, "encoder_layers": max(1, round(AUDIO["encoder_layers"] * depth_frac))}
    text = {**TEXT, "num_hidden_layers": max(1, round(TEXT["num_hidden_layers"] * depth_frac))}
    config = transformers.Qwen3ASRConfig(text_config=text, audio_config=audio,
                                         audio_token_id=tok.token_to_id("<|audio_pad|>"), eos_token_id=2,
                                         pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ASRForConditionalGeneration(config).to(torch.float32).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": t.CHAT_TEMPLATE,
        "extra_special_tokens": {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                                 "audio_eos_token": "<|audio_end|>"}}))
    (path / "preprocessor_config.json").write_text(json.dumps({"feature_size": 128, "sampling_rate": 16000}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth-frac", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/audio-bench"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["DECODERT_THREADS"] = str(args.threads)  # torch; ort (ort_session.py)
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE / "tests" / "helpers"))
    import tiny_qwen3_asr as t

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf = make_checkpoint(args.work / f"hf-{args.depth_frac:g}", args.depth_frac)
    art = args.work / f"art-{args.depth_frac:g}"
    if not (art / "manifest.json").is_file():
        export_model(hf, art, target="ort", dtype="fp32", max_seq=2048, max_batch=1, progress=False)
    llm = LLM.load(art, backend="ort")
    model = transformers.Qwen3ASRForConditionalGeneration.from_pretrained(hf).eval()
    processor = transformers.Qwen3ASRProcessor(
        feature_extractor=transformers.Qwen3ASRFeatureExtractor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(str(hf)), chat_template=t.CHAT_TEMPLATE)
    rows: dict[str, list[float]] = {k: [] for k in ("decodert_encode", "torch_encode", "decodert_rtf", "torch_rtf")}
    same = True
    for r in range(args.repeats + 1):  # the first round warms both up and is not counted
        clip = t.speech_like(args.seconds, seed=100 + r)
        t0 = time.perf_counter()
        llm.audio.embeddings(clip)
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = llm.transcribe(clip, sample_rate=16000, language="en", max_new_tokens=args.tokens, temperature=0)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.inference_mode():
            f = processor.feature_extractor(clip, sampling_rate=16000, padding=True, return_tensors="pt",
                                            return_attention_mask=True)
            model.get_audio_features(f["input_features"], f["attention_mask"])
        tenc = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.inference_mode():
            inputs = processor.apply_transcription_request(clip, language="en")
            out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False)
        theirs = time.perf_counter() - t0
        same &= out[0, inputs["input_ids"].shape[1]:].tolist() == got.token_ids[:out.shape[1] - inputs["input_ids"].shape[1]]
        if r:
            for k, v in (("decodert_encode", enc), ("torch_encode", tenc), ("decodert_rtf", ours / args.seconds),
                         ("torch_rtf", theirs / args.seconds)):
                rows[k].append(v)
        m = got.metrics
        print(f"repeat {r}{' (warm-up)' if not r else ''}: decodert encode {enc:.3f} s, RTF {ours / args.seconds:.3f} "
              f"({len(got.token_ids)} tokens; prefill of {m.prompt_tokens} + encode {m.ttft_s:.2f} s, "
              f"{m.tpot_ms:.0f} ms a token) | torch encode {tenc:.3f} s, RTF {theirs / args.seconds:.3f}", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"Qwen3-ASR-0.6B shape x{args.depth_frac:g} depth, {args.seconds:g} s clip, {args.tokens} tokens, "
          f"{args.threads} threads: decodert RTF {med['decodert_rtf']:.3f} (encode {med['decodert_encode']:.3f} s), "
          f"torch RTF {med['torch_rtf']:.3f} (encode {med['torch_encode']:.3f} s), "
          f"speed-up x{med['torch_rtf'] / med['decodert_rtf']:.2f}; same tokens: {same}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "median": med,
                                         "same_tokens": same}, indent=2))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
