"""A tiny random Qwen2.5-VL checkpoint with its tokenizer, chat template and preprocessor config (test-only
helper), and transformers' own processor for it (the reference the tests compare with).

    path = make_tiny_qwen_vl(tmp_path / "qvl")   # 8-px patches, 2x2 merge, 32-px windows, 3 ViT layers
    processor = reference_processor(path)          # Qwen2_5_VLProcessor over the PIL image processor
    make_tiny_qwen_vl(path, kind="qwen3_vl")       # Qwen3-VL: learned positions, deepstack, interleaved M-RoPE
    make_tiny_qwen_vl(path, kind="qwen3_5")        # Qwen3.5: Qwen3-VL's tower without deepstack, a hybrid text
                                                   # model (Gated DeltaNet, gated attention, M-RoPE on a quarter)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny import SPECIAL_TOKENS, _CORPUS

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = 600
PATCH, MERGE, WINDOW = 8, 2, 32
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128
CHAT_TEMPLATE = (  # Qwen2.5-VL's template, without its default system turn
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS + VISION_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS + "user assistant What is in this image?\n"] * 4, trainer)
    tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    return tok


def make_tiny_qwen_vl(path: str | Path, seed: int = 0, kind: str = "qwen2_5_vl") -> Path:
    """``kind``: "qwen2_5_vl" (window attention, M-RoPE sections 2/3/3) or "qwen3_vl" (q/k norm text, interleaved
    M-RoPE, learned 6x6 positions, deepstack after ViT layers 0 and 1 into text layers 0 and 1) or "qwen3_5"
    (Qwen3-VL's tower without deepstack; text: linear, full, linear layers, 2 key heads serving 4 value heads,
    a conv of 4 taps, interleaved M-RoPE 3/3/2 on a quarter of each 64-dim head) or "qwen3_5_moe" (the same with
    every MLP 4 experts, top 2, beside a gated shared expert)."""
    import torch
    import transformers

    path = Path(path)
    tok = make_tokenizer()
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3 if kind != "qwen2_5_vl"
                else 2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                bos_token_id=0, eos_token_id=2, tie_word_embeddings=False, rope_parameters=rope)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2)
    if kind == "qwen3_vl":
        text.update(head_dim=16, rope_parameters={**rope, "mrope_interleaved": True})
        vision.update(num_position_embeddings=36, deepstack_visual_indexes=[0, 1])
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        text.update(head_dim=64, layer_types=["linear_attention", "full_attention", "linear_attention"],
                    linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=8,
                    rope_parameters={**rope, "mrope_section": [3, 3, 2], "mrope_interleaved": True,
                                     "partial_rotary_factor": 0.25})
        vision.update(num_position_embeddings=36)
        if kind == "qwen3_5_moe":  # 4 experts of 32, top 2, beside a gated shared expert of 48
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48)
            del text["intermediate_size"]
    else:
        vision.update(window_size=WINDOW, fullatt_block_indexes=[1], tokens_per_second=1)
    prefix = {"qwen3_vl": "Qwen3VL", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen2_5_vl": "Qwen2_5_VL"}[kind]
    Config, Model = (getattr(transformers, prefix + x) for x in ("Config", "ForConditionalGeneration"))
    config = Config(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                    video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                    vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random (norm weights near 1), reproducibly
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            norm = ("norm" in name or "ln_q" in name) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if norm else 0.05 * noise)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(processor_settings(), indent=2))
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_settings(kind), indent=2))
    return path


def processor_settings() -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
            "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def video_settings(kind: str) -> dict:
    """The tiny checkpoint's video_preprocessor_config.json: Qwen2.5-VL keeps every frame (per-frame pixel bounds),
    Qwen3-VL samples 2 per second (its bounds over frames x pixels)."""
    common = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2, "resample": 3, "do_resize": True,
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "min_frames": 4, "max_frames": 768}
    if kind != "qwen2_5_vl":  # Qwen3-VL's, and Qwen3.5's (AutoVideoProcessor: Qwen3VLVideoProcessor)
        return {**common, "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True, "fps": 2,
                "size": {"shortest_edge": MIN_PIXELS, "longest_edge": 6 * 64 * 64},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    return {**common, "video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": False, "fps": None,
            "min_pixels": MIN_PIXELS, "max_pixels": 96 * 96,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def reference_processor(path: Path, kind: str = "qwen2_5_vl") -> Any:
    """transformers' Qwen2_5_VLProcessor / Qwen3VLProcessor (AutoProcessor's choice for qwen3_vl, qwen3_5 and
    qwen3_5_moe) for the checkpoint, with the PIL image processor and its video processor's steps
    (tests/helpers/qwen_video_reference.py: no torchvision)."""
    from qwen_video_reference import ReferenceVideoProcessor

    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = processor_settings()
    settings.pop("image_processor_type")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    class ImagesOnly(Qwen3VLProcessor if kind in ("qwen3_vl", "qwen3_5", "qwen3_5_moe") else Qwen2_5_VLProcessor):  # type: ignore[misc]  # no video processor: its lookup needs torchvision, images do not
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    video = {k: v for k, v in video_settings(kind).items() if k != "video_processor_type"}
    return ImagesOnly(Qwen2VLImageProcessorPil(**settings), tokenizer, ReferenceVideoProcessor(
        "qwen2_5_vl" if kind == "qwen2_5_vl" else "qwen3_vl", video),
                      chat_template=CHAT_TEMPLATE)


# ---- what the Qwen-VL tests ask, and transformers' answer to it --------------------------------------------------
def random_image(rng: Any, h: int, w: int) -> Any:
    """An HxWx3 uint8 image of random pixels."""
    return rng.integers(0, 256, (h, w, 3), dtype="uint8")


def ask(*images: Any, text: str = "What is in this image?") -> list[dict]:
    """One user message: the images, then the question."""
    parts = [{"type": "image", "image": img} for img in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def reference_inputs(proc: Any, text: str, images: Any) -> Any:
    """transformers' processor on the rendered text and the images (torch tensors)."""
    from PIL import Image

    return proc(text=text, images=[Image.fromarray(i) for i in images], return_tensors="pt")


def reference_tokens(model: Any, proc: Any, text: str, images: Any, n: int = 8) -> list[int]:
    """transformers' greedy continuation (``n`` tokens) of the text with its images."""
    import torch

    ref = reference_inputs(proc, text, images)
    with torch.no_grad():
        out = model.generate(**ref, max_new_tokens=n, do_sample=False)
    return out[0, ref["input_ids"].shape[1]:].tolist()


# ---- checks every Qwen tower runs (Qwen2.5-VL, Qwen3-VL, Qwen3.5): llm is an LLM on the tiny checkpoint ---------
SIZES = [(70, 50), (20, 30), (100, 160), (120, 300)]


def fresh(llm: Any) -> None:
    """Forget what the prefix cache holds, so the next call prefills from the start."""
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()


def check_greedy_tokens(llm: Any, model: Any, proc: Any, rng: Any) -> None:
    """Greedy tokens equal transformers' for three image sizes and for two images in one message."""
    from PIL import Image

    for h, w in SIZES[:3]:
        img = random_image(rng, h, w)
        fresh(llm)
        result = llm.chat(ask(img), max_new_tokens=8, temperature=0)
        _, text, _ = llm.prepare(ask(img), chat=True).rendered
        assert result.token_ids == reference_tokens(model, proc, text, [img]), (h, w)
    two = [random_image(rng, 90, 60), random_image(rng, 64, 64)]  # two images in one message
    msgs = ask(two[0], Image.fromarray(two[1]), text="and")
    _, text, _ = llm.prepare(msgs, chat=True).rendered
    assert llm.chat(msgs, max_new_tokens=8, temperature=0).token_ids == reference_tokens(model, proc, text, two)


def check_batch_equals_singles(llm: Any, rng: Any) -> None:
    """Two image prompts of different sizes and a text one in a batch give each one's tokens alone."""
    asks = [ask(random_image(rng, 70, 50)), ask(random_image(rng, 100, 160), text="Hello?"),
            [{"role": "user", "content": "Hi"}]]
    fresh(llm)
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    fresh(llm)
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles


def check_chunked_prefill(llm: Any, rng: Any) -> None:
    """Prefill chunks of 20 tokens cutting through an image's 72 give the tokens of one call."""
    img = random_image(rng, 120, 300)
    fresh(llm)
    want = llm.chat(ask(img), max_new_tokens=6, temperature=0).token_ids
    chunk, llm.backend.prefill_chunk = llm.backend.prefill_chunk, 20
    try:
        fresh(llm)
        again = llm.chat(ask(img), max_new_tokens=6, temperature=0)
        assert again.metrics.cached_tokens == 0 and again.token_ids == want
    finally:
        llm.backend.prefill_chunk = chunk


def check_follow_up(llm: Any, rng: Any) -> None:
    """A session's second question about an image prefills only the new turn and equals a full re-prefill."""
    img = random_image(rng, 100, 160)
    chat = llm.session()
    first = chat.chat(ask(img, text="What?")[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And the colour?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the image was not prefilled again
    fresh(llm)
    again = llm.chat(chat.history[:-1], max_new_tokens=5, temperature=0)
    assert second.token_ids == again.token_ids
    chat.close()
