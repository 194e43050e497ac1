"""Gemma 3 vision on ONNX Runtime (issue 35): what the bidirectional image attention costs in prefill, and
the vision TTFT, on a random Gemma-3-270M-shaped text model (18 layers, hidden 640, 4 heads / 1 KV head
of 256, sliding window 512 on 5 of 6 layers; vocabulary cut to 32768) with a SigLIP-B tower (768 x 12
layers) on 448-px images of 14-px patches pooled 2x2 to 256 image tokens.

    python bench/gemma3_vision.py [--threads 2] [--repeats 5] [--work /tmp/decodert-g3-bench] [--json out.json]

The same checkpoint is exported twice: with its vision tower (prefill graph with the image_ahead If,
export/lowering/image_attention.py) and as its text model only (plain GroupQueryAttention). Medians over
``--repeats``, alternating the two artifacts:
- text prefill: a 1-token answer to a ~300-token text prompt on each artifact (the If's cost for text);
- image prefill: the prefill of the image prompt's ids (~290 tokens, 256 image tokens, embeddings cached),
  against the text-only artifact prefilling the same number of text tokens;
- encode (preprocess + vision.onnx), first TTFT (image + question, new session) and follow-up TTFT.
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

TEXT = dict(model_type="gemma3_text", hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=32768, sliding_window=512,
            query_pre_attn_scalar=256, max_position_embeddings=32768, sliding_window_pattern=6)
VISION = dict(model_type="siglip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, image_size=448, patch_size=14, vision_use_head=False)
MM_TOKENS = 256


def make_checkpoint(path: Path) -> Path:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from tiny_gemma3_vision import CHAT_TEMPLATE, SPECIAL, TOKENS, make_tokenizer

    tok = make_tokenizer()
    tok.add_tokens([f"<|pad_{i}|>" for i in range(TEXT["vocab_size"] - tok.get_vocab_size())])
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    config = Gemma3Config(text_config={**TEXT, "bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"]},
                          vision_config=VISION, mm_tokens_per_image=MM_TOKENS,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).to(torch.float32).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE, **TOKENS}))
    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 448, "width": 448}}))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": MM_TOKENS}))
    return path


def text_only(hf: Path, dst: Path) -> Path:
    """The same folder with config.json's vision_config removed: decodert exports the text model only."""
    import shutil

    shutil.copytree(hf, dst)
    config = json.loads((hf / "config.json").read_text())
    config.pop("vision_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def prefill_s(llm, ids: np.ndarray) -> float:
    cache = llm.backend.allocate(1)
    t0 = time.perf_counter()
    llm.backend.prefill(cache, [0], [ids], False)
    return time.perf_counter() - t0


def measure(vision_art: Path, text_art: Path, repeats: int) -> dict:
    from decodert.runtime.llm import LLM

    rng = np.random.default_rng(0)
    rows: dict[str, list[float]] = {k: [] for k in ("text_prefill_vision_art_s", "text_prefill_text_art_s",
                                                    "image_prefill_s", "same_length_text_prefill_s", "encode_s",
                                                    "first_s", "follow_up_s")}
    words = "the cache keeps keys and values of earlier positions so each step computes one token " * 20
    with LLM.load(vision_art, backend="ort", prefix_cache_mb=0) as vl, LLM.load(text_art, backend="ort",
                                                                                prefix_cache_mb=0) as tl:
        text_ids = tl.encode(words)[:300]
        for _ in range(repeats):
            rows["text_prefill_vision_art_s"].append(prefill_s(vl, text_ids))
            rows["text_prefill_text_art_s"].append(prefill_s(tl, text_ids))
            img = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
            t0 = time.perf_counter()
            vl.vision.entry(img)
            rows["encode_s"].append(time.perf_counter() - t0)
            ask = {"role": "user", "content": [{"type": "image", "image": img},
                                               {"type": "text", "text": "What is in this image?"}]}
            _, _, ids = vl.prepare([ask], chat=True).rendered
            rows["image_prefill_s"].append(prefill_s(vl, ids))
            rows["same_length_text_prefill_s"].append(prefill_s(tl, np.resize(text_ids, len(ids))))
            vl.vision.store = type(vl.vision.store)()  # forget it: "first" encodes again
            vl.backend.images = vl.vision.store
            chat = vl.session()
            t0 = time.perf_counter()
            chat.chat(ask, max_new_tokens=1, temperature=0)
            rows["first_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            chat.chat("And what colour is it?", max_new_tokens=1, temperature=0)
            rows["follow_up_s"].append(time.perf_counter() - t0)
            chat.close()
        out: dict = {k: statistics.median(v) for k, v in rows.items()}
        out["image_prompt_tokens"] = int(len(ids))
    out["if_cost_text"] = out["text_prefill_vision_art_s"] / out["text_prefill_text_art_s"]
    out["image_over_text_prefill"] = out["image_prefill_s"] / out["same_length_text_prefill_s"]
    out["follow_up_over_first"] = out["follow_up_s"] / out["first_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/decodert-g3-bench"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["DECODERT_THREADS"] = str(args.threads)
    from decodert.export.pipeline import export_model

    hf, art, text_art = args.work / "hf", args.work / "art", args.work / "art-text"
    if not (art / "manifest.json").is_file():
        make_checkpoint(hf)
        export_model(hf, art, target="ort", dtype="fp32", max_seq=2048, max_batch=1, progress=False)
        export_model(text_only(hf, args.work / "hf-text"), text_art, target="ort", dtype="fp32", max_seq=2048,
                     max_batch=1, progress=False)
    r = measure(art, text_art, args.repeats)
    print(f"text prefill 300 tokens: vision artifact {r['text_prefill_vision_art_s'] * 1000:.1f} ms vs text-only "
          f"{r['text_prefill_text_art_s'] * 1000:.1f} ms ({r['if_cost_text']:.3f}x)\n"
          f"image prompt prefill ({r['image_prompt_tokens']} tokens): {r['image_prefill_s'] * 1000:.1f} ms vs the same "
          f"length of text {r['same_length_text_prefill_s'] * 1000:.1f} ms ({r['image_over_text_prefill']:.3f}x)\n"
          f"encode {r['encode_s'] * 1000:.0f} ms | TTFT first {r['first_s'] * 1000:.0f} ms | follow-up "
          f"{r['follow_up_s'] * 1000:.0f} ms ({r['follow_up_over_first']:.3f}x)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "results": r}, indent=2))


if __name__ == "__main__":
    main()
