"""A tiny random Gemma 3 vision checkpoint (Gemma3ForConditionalGeneration) with its tokenizer, a Gemma 3
chat template and processor configs (test-only helper), and transformers' own processor for it.

    path = make_tiny_gemma3_vlm(tmp_path / "g3")   # 64x64 images of 8x8 patches pooled 2x2: 16 tokens per image
    processor = reference_processor(path)          # Gemma3Processor over the PIL image processor
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny import _CORPUS, _randomise

SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
           "<image_soft_token>"]
TOKENS = dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")
VOCAB = 512
IMAGE, PATCH, MM_TOKENS = 64, 8, 16
CHAT_TEMPLATE = (  # Gemma 3's template, without its system-prompt handling
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
    "{% endif %}")


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS + "user model What is in this image?\n"] * 4, trainer)
    tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    return tok


def make_tiny_gemma3_vlm(path: str | Path, seed: int = 0, sliding_window: int = 8) -> Path:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = Path(path)
    tok = make_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    config = Gemma3Config(
        text_config=dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, intermediate_size=128,
                         max_position_embeddings=2048, sliding_window=sliding_window, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], bos_token_id=ids["<bos>"],
                         eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE, patch_size=PATCH,
                           vision_use_head=False),
        mm_tokens_per_image=MM_TOKENS, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    _randomise(model, seed)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE, **TOKENS}, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": IMAGE, "width": IMAGE}, "resample": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
        "do_pan_and_scan": False}, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": MM_TOKENS}))
    return path


def reference_processor(path: Path) -> Any:
    """transformers' Gemma3Processor for the checkpoint, with the PIL image processor (no torchvision)."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    settings = json.loads((path / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", extra_special_tokens=TOKENS)
    return Gemma3Processor(Gemma3ImageProcessorPil(**settings), tokenizer, image_seq_length=MM_TOKENS,
                           chat_template=CHAT_TEMPLATE)
