"""Vision-language TTFT (issue 35): vision encode time, first-question TTFT and follow-up TTFT for one
448x448 image on a SmolVLM-256M-shaped random checkpoint (SigLIP 768 x 12 layers, 512-px tiles of
16-px patches, pixel shuffle 4 -> 64 tokens a tile; SmolLM2-135M text model), or (``--model qwen2_5_vl``)
a Qwen2.5-VL-3B-shaped one (ViT 1280 x 32 layers, 14-px patches, 112-px windows, full attention every 8th
layer, 2x2 merger; Qwen2.5-3B text model 2048 x 36 layers, int4) whose depths ``--depth-frac`` scales
(1/4 by default: 8 ViT and 9 text layers, so the checkpoint, 1.2 GB exported, fits a shared machine;
multiply the times by about 1 / depth-frac for the full shape), or (``--model qwen3_5``) Qwen3.5-0.8B's hybrid
text model (24 layers: Gated DeltaNet and gated attention, int4) under a Qwen3-VL-2B-sized tower (an assumption:
ViT 1024 x 24, 16-px patches, no deepstack), depths scaled the same way (``--depth-frac 1``: the full shape).

    python bench/vision.py [--model smolvlm|qwen2_5_vl|qwen3_5] [--depth-frac 0.25] [--threads 2] [--repeats 5]
                           [--work /tmp/vision-bench] [--json out.json]

Two processor settings: SmolVLM-256M's own (``size.longest_edge`` 2048, splitting: a 448x448 image is
resized to 2048x2048, 4x4 tiles + the global one = 17 tiles, 1088 image tokens) and without splitting
(one 512x512 tile, 64 image tokens). Per repeat, a fresh random image (nothing cached):
- encode: preprocessing (numpy + Pillow) + vision.onnx, in ``Vision.entry``;
- first: wall time of a 1-token answer to "image + question" in a new session (encode included);
- follow-up: wall time of a 1-token answer to a second question in the same session (the image's
  tokens are held by the session's row: only the new turn is prefilled).
Wall time of a 1-token answer is the TTFT a caller sees (rendering, tokenizing, the image, prefill).
Medians over ``--repeats``. onnxruntime-genai is not compared: its model builder (0.18) has no
Idefics3 / SmolVLM architecture, and for Qwen2.5-VL it builds only the text decoder (Qwen25VLTextModel,
inputs_embeds in), not the vision tower, so it has no end-to-end image path to time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    """A random SmolVLM-256M-shaped Idefics3 checkpoint with tests/helpers/tiny_vision.py's tokenizer layout."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
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


QWEN_TEXT = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                   patch_size=14, window_size=112, spatial_merge_size=2, temporal_patch_size=2,
                   fullatt_block_indexes=[7, 15, 23, 31])


# Qwen3.5-0.8B's text model (bench/hybrid.py's published shape) under a Qwen3-VL-2B-sized tower (ViT 1024 x 24
# layers, 16-px patches, learned 48x48 positions): Qwen3.5-0.8B's own vision_config is not at hand here, so the tower
# is an assumption; the processor is Qwen3-VL's (a 448x448 image stays 448x448: 196 tokens)
QWEN35_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=1024,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)


def _qwen_config(kind: str, depth_frac: float, ids: dict[str, int]) -> tuple[object, type, dict]:
    """(config, model class, preprocessor_config.json) of the Qwen2.5-VL-3B or Qwen3.5-0.8B shape, depths scaled."""
    import transformers

    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "qwen3_5":
        from hybrid import QWEN35_08B

        layers = max(4, 4 * round(QWEN35_08B["num_hidden_layers"] * depth_frac / 4))  # whole 3+1 groups
        text = {**QWEN35_08B, "num_hidden_layers": layers,
                "rope_parameters": {**QWEN35_08B["rope_parameters"], "mrope_section": [11, 11, 10],
                                    "mrope_interleaved": True}}
        vision = {**QWEN35_VISION, "depth": max(1, round(QWEN35_VISION["depth"] * depth_frac))}
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens)
        return config, transformers.Qwen3_5ForConditionalGeneration, {
            "size": {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}, "patch_size": 16, "merge_size": 2,
            "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    depth = max(1, round(QWEN_VISION["depth"] * depth_frac))
    vision = {**QWEN_VISION, "depth": depth, "fullatt_block_indexes": list(range(7, depth, 8))}  # every 8th
    text = {**QWEN_TEXT, "num_hidden_layers": max(1, round(QWEN_TEXT["num_hidden_layers"] * depth_frac)),
            "tie_word_embeddings": True}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens)
    return config, transformers.Qwen2_5_VLForConditionalGeneration, {  # Qwen2.5-VL-3B-Instruct's: 448x448 stays
        "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2}


VISUAL_SHARD = "model-visual.safetensors"


def make_qwen_checkpoint(path: Path, depth_frac: float, kind: str = "qwen2_5_vl") -> Path:
    """A random Qwen2.5-VL-3B- or Qwen3.5-0.8B-shaped checkpoint (depths x ``depth_frac``), written shard by shard
    in bf16 (the model is built on the meta device: no fp32 copy in memory), with tests/helpers/tiny_qwen_vl.py's tokenizer."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from tiny_qwen_vl import CHAT_TEMPLATE, make_tokenizer

    tok = make_tokenizer()
    ids = {t: tok.token_to_id(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    config, model_class, preprocessor = _qwen_config(kind, depth_frac, ids)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in model_class(config).state_dict().items()
                  if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    # shards of at most ~2 GB (the memory one holds), the vision tower's alone in VISUAL_SHARD (kept for torch)
    keys = sorted(shapes, key=lambda k: "visual." not in k)
    groups: list[list[str]] = [[]]
    for k in keys:
        full = groups[-1] and (sum(shapes[j].numel() for j in groups[-1]) * 2 > 2e9
                               or ("visual." in groups[-1][-1]) != ("visual." in k))
        if full:
            groups.append([k])
        else:
            groups[-1].append(k)
    files = [VISUAL_SHARD if "visual." in g[0] else f"model-text-{i}.safetensors" for i, g in enumerate(groups)]
    for file, group in zip(files, groups):
        save_file({k: (torch.ones(shapes[k]) if "norm" in k or "ln_q" in k else
                       torch.randn(shapes[k], generator=gen) * 0.02).to(torch.bfloat16) for k in group},
                  str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, g in zip(files, groups) for k in g}}))
    config.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


def qwen_artifact(work: Path, depth_frac: float, acc: int = 0, kind: str = "qwen2_5_vl") -> tuple[Path, Path]:
    """(artifact, torch tower folder) of the Qwen2.5-VL-3B (or ``kind`` qwen3_5) shape x ``depth_frac``, made when
    missing: checkpoint,
    export (text int4, vision fp32), the checkpoint deleted but its vision tower shard (for
    bench/vision_encode.py's torch reference). Peak disk: checkpoint + artifact (7.5 + 4.2 GB at full depth)."""
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    prefix = "qwen" if kind == "qwen2_5_vl" else kind  # qwen-*: the folders earlier runs left
    tag = f"{prefix}-{depth_frac:g}" + (f"-acc{acc}" if acc else "")
    hf, art, tower = work / f"hf-{tag}", work / f"art-{tag}", work / f"torch-{prefix}-{depth_frac:g}"
    if not (art / "manifest.json").is_file():
        make_qwen_checkpoint(hf, depth_frac, kind)
        export_model(hf, art, target="ort", dtype="fp32", max_seq=2048, max_batch=1, progress=False,
                     quant=QuantConfig(bits=4, scale_search=False, accuracy_level=acc))
        if not (tower / "visual.safetensors").is_file():
            tower.mkdir(parents=True, exist_ok=True)
            (hf / VISUAL_SHARD).rename(tower / "visual.safetensors")
            config = json.loads((hf / "config.json").read_text())
            (tower / "vision_config.json").write_text(json.dumps(config["vision_config"]))
        shutil.rmtree(hf)  # the bf16 checkpoint; the artifact is what is measured
    return art, tower


def smol_artifact(work: Path, splitting: bool) -> tuple[Path, Path]:
    """(artifact, checkpoint) of the SmolVLM-256M shape, made when missing (the checkpoint, 1 GB, is kept)."""
    from decodert.export.pipeline import export_model

    hf, art = work / f"hf-{splitting}", work / f"art-{splitting}"
    if not (art / "manifest.json").is_file():
        make_checkpoint(hf, splitting)
        export_model(hf, art, target="ort", dtype="fp32", max_seq=2048, max_batch=1, progress=False)
    return art, hf


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
    ap.add_argument("--model", choices=("smolvlm", "qwen2_5_vl", "qwen3_5"), default="smolvlm")
    ap.add_argument("--depth-frac", type=float, default=0.25, help="qwen2_5_vl / qwen3_5: depths of the shape kept")
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch tower (bench/vision_encode.py; "
                    "qwen3_5 has none)")
    ap.add_argument("--accuracy-level", type=int, default=0, help="qwen2_5_vl: MatMulNBits accuracy level (4: int8 "
                    "activations, faster prefill)")
    args = ap.parse_args()
    os.environ["DECODERT_THREADS"] = str(args.threads)
    results = {}
    acc = args.accuracy_level
    shape = {"qwen2_5_vl": "qwen2.5-vl-3b", "qwen3_5": "qwen3.5-0.8b text, qwen3-vl-2b-sized tower,"}.get(args.model)
    cases = ((f"{shape} shape x{args.depth_frac:g} depth (int4 text, accuracy level {acc})", None),) \
        if shape else (("smolvlm-256m (17 tiles)", True), ("no splitting (1 tile)", False))
    for name, splitting in cases:
        art, peer = qwen_artifact(args.work, args.depth_frac, acc, args.model) if splitting is None else \
            smol_artifact(args.work, splitting)
        results[name] = measure(art, args.repeats)
        r = results[name]
        line = (f"{name}: {r['image_tokens']} image tokens | encode {r['encode_s'] * 1000:.0f} ms | TTFT first "
                f"{r['first_s'] * 1000:.0f} ms | follow-up {r['follow_up_s'] * 1000:.0f} ms "
                f"({r['follow_up_over_first']:.3f}x)")
        if not args.no_torch and args.model != "qwen3_5":  # the reference peer: transformers' tower, encode alone
            import vision_encode

            peer_r = vision_encode.measure(art, peer, args.threads, args.repeats, torch=True)
            r.update({f"encode_only_{k}": v for k, v in peer_r.items()})
            line += (f" | vision.onnx alone {peer_r['decodert_s'] * 1000:.0f} ms, torch tower "
                     f"{peer_r['torch_s'] * 1000:.0f} ms, FLOP floor {peer_r['floor_s'] * 1000:.0f} ms")
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    main()
