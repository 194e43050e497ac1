"""A tiny random Idefics3 (SmolVLM) checkpoint with its tokenizer, chat template and processor configs
(test-only helper), and transformers' own processor for it (the reference the tests compare with).

    path = make_tiny_vlm(tmp_path / "vlm")    # 64x64 tiles of 8x8 patches, r = 2: 16 tokens per tile
    processor = reference_processor(path)      # Idefics3Processor over the PIL image processor
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny import SPECIAL_TOKENS, _CORPUS, _randomise

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
VOCAB = 600
TILE, PATCH, SCALE, LONGEST = 64, 8, 2, 160  # tiles of 64 px, images resized to 160 px at most
CHAT_TEMPLATE = (  # SmolVLM's template (transformers' processing_smolvlm DEFAULT_CHAT_TEMPLATE)
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def make_vlm_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS + IMAGE_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS + "User: Assistant: What is in this image?\n"] * 4, trainer)
    tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    return tok


def make_tiny_vlm(path: str | Path, seed: int = 0, splitting: bool = True, kind: str = "idefics3") -> Path:
    """``kind``: "idefics3" (SmolVLM-256M/500M/2B) or "smolvlm" (SmolVLM2: the same tower and text model)."""
    import torch
    import transformers

    Config, Model = (getattr(transformers, f"{'Idefics3' if kind == 'idefics3' else 'SmolVLM'}{x}")
                     for x in ("Config", "ForConditionalGeneration"))

    path = Path(path)
    tok = make_vlm_tokenizer()
    config = Config(
        text_config=dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, intermediate_size=128,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2,
                         tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH),
        scale_factor=SCALE, image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32)
    _randomise(model, seed)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<end_of_utterance>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": splitting,
        "max_image_size": {"longest_edge": TILE}, "size": {"longest_edge": LONGEST}, "resample": 1,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": tokens_per_tile()}))
    return path


def tokens_per_tile() -> int:
    return (TILE // PATCH) ** 2 // SCALE ** 2


def reference_processor(path: Path) -> Any:
    """transformers' Idefics3Processor for the checkpoint, with the PIL image processor (no torchvision)."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    settings = json.loads((path / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<|endoftext|>",
                                        eos_token="<end_of_utterance>", pad_token="<|endoftext|>")
    return Idefics3Processor(Idefics3ImageProcessorPil(**settings), tokenizer, image_seq_len=tokens_per_tile(),
                             chat_template=CHAT_TEMPLATE)
