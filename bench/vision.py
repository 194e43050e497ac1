"""Vision-language TTFT (issue 35): vision encode time, first-question TTFT and follow-up TTFT for one
448x448 image on a SmolVLM-256M-shaped random checkpoint (SigLIP 768 x 12 layers, 512-px tiles of
16-px patches, pixel shuffle 4 -> 64 tokens a tile; SmolLM2-135M text model).

    python bench/vision.py [--threads 2] [--repeats 5] [--work /tmp/vision-bench] [--json out.json]

Two processor settings: SmolVLM-256M's own (``size.longest_edge`` 2048, splitting: a 448x448 image is
resized to 2048x2048, 4x4 tiles + the global one = 17 tiles, 1088 image tokens) and without splitting
(one 512x512 tile, 64 image tokens). Per repeat, a fresh random image (nothing cached):
- encode: preprocessing (numpy + Pillow) + vision.onnx, in ``Vision.entry``;
- first: wall time of a 1-token answer to "image + question" in a new session (encode included);
- follow-up: wall time of a 1-token answer to a second question in the same session (the image's
  tokens are held by the session's row: only the new turn is prefilled).
Wall time of a 1-token answer is the TTFT a caller sees (rendering, tokenizing, the image, prefill).
Medians over ``--repeats``. onnxruntime-genai is not compared: its model builder (0.18) has no
Idefics3 / SmolVLM architecture.
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

TEXT = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            intermediate_size=1536, vocab_size=49280, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              image_size=512, patch_size=16)


def make_checkpoint(path: Path, splitting: bool) -> Path:
    """A random SmolVLM-256M-shaped Idefics3 checkpoint with tests/tiny_vision.py's tokenizer layout."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_vision import CHAT_TEMPLATE, make_vlm_tokenizer

    tok = make_vlm_tokenizer()
    tok.add_tokens([f"<|pad_{i}|>" for i in range(TEXT["vocab_size"] - tok.get_vocab_size())])
    config = Idefics3Config(text_config=TEXT, vision_config=VISION, scale_factor=4,
                            image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).to(torch.float32).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<end_of_utterance>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "do_image_splitting": splitting, "max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048},
        "resample": 1}))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    return path


def measure(art: Path, repeats: int) -> dict:
    from decodert.runtime.llm import LLM

    rng = np.random.default_rng(0)
    rows: dict[str, list[float]] = {"encode_s": [], "first_s": [], "follow_up_s": []}
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as llm:
        llm.chat([{"role": "user", "content": "warm up"}], max_new_tokens=1)
        tokens = 0
        for _ in range(repeats):
            img = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
            t0 = time.perf_counter()
            entry = llm.vision.entry(img)
            rows["encode_s"].append(time.perf_counter() - t0)
            tokens = len(entry.ids)
            llm.vision.store = type(llm.vision.store)()  # forget it: "first" encodes again
            llm.backend.images = llm.vision.store
            chat = llm.session()
            t0 = time.perf_counter()
            chat.chat({"role": "user", "content": [{"type": "image", "image": img},
                                                   {"type": "text", "text": "What is in this image?"}]},
                      max_new_tokens=1, temperature=0)
            rows["first_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            chat.chat("And what colour is it?", max_new_tokens=1, temperature=0)
            rows["follow_up_s"].append(time.perf_counter() - t0)
            chat.close()
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["image_tokens"] = tokens
    out["follow_up_over_first"] = out["follow_up_s"] / out["first_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/decodert-vision-bench"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["DECODERT_THREADS"] = str(args.threads)
    from decodert.export.pipeline import export_model

    results = {}
    for name, splitting in (("smolvlm-256m (17 tiles)", True), ("no splitting (1 tile)", False)):
        hf, art = args.work / f"hf-{splitting}", args.work / f"art-{splitting}"
        if not (art / "manifest.json").is_file():
            make_checkpoint(hf, splitting)
            export_model(hf, art, target="ort", dtype="fp32", max_seq=2048, max_batch=1, progress=False)
        results[name] = measure(art, args.repeats)
        r = results[name]
        print(f"{name}: {r['image_tokens']} image tokens | encode {r['encode_s'] * 1000:.0f} ms | TTFT first "
              f"{r['first_s'] * 1000:.0f} ms | follow-up {r['follow_up_s'] * 1000:.0f} ms "
              f"({r['follow_up_over_first']:.3f}x)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    main()
