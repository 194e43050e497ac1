"""A tiny random Gemma 4 checkpoint with an audio tower (Gemma4ForConditionalGeneration, no vision tower), its
tokenizer, chat template and preprocessor config (test-only helper), and transformers' own processor for it.

    path = make_tiny_gemma4_audio(tmp_path / "g4a")   # 32 mels, 2 conformer layers, chunks of 12 rows
    processor = reference_processor(path)            # Gemma4Processor over Gemma4AudioFeatureExtractor

The clips are tests/helpers/tiny_qwen3_asr.py's ``speech_like``. Every clipped linear of the tower has finite
random bounds (tight enough that some values are clipped) but layer 1's attention output, whose bounds stay
infinite (transformers' initial values), as a checkpoint may leave them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny import SPECIAL_TOKENS, _CORPUS, tiny_config

MEDIA_TOKENS = ["<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
TURN_TOKENS = ["<|turn>", "<turn|>"]
VOCAB = 512
MELS = 32
RATE = 16000
# Gemma 4's turns (a system turn of its own, the assistant's named "model"); an audio part is the processor's
# placeholder <|audio|> (Gemma4Processor expands it to <|audio> + n x <|audio|> + <audio|>)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'audio' %}<|audio|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIAL_TOKENS + TURN_TOKENS + MEDIA_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS + "user model Transcribe the following speech segment in\n"] * 4, trainer)
    tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    return tok


def _audio_config(**audio: Any) -> dict[str, Any]:
    return {**dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[32, 8],
                   conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                   attention_logit_cap=50.0, output_proj_dims=24, rms_norm_eps=1e-6), **audio}


def make_tiny_gemma4_audio(path: str | Path, seed: int = 0, **audio: Any) -> Path:
    """``audio``: Gemma4AudioConfig fields over the tiny ones (chunks of 12 rows, 12 rows of left context)."""
    import torch
    import transformers

    path = Path(path)
    tok = make_tokenizer()
    ids = {t: tok.token_to_id(t) for t in MEDIA_TOKENS}
    text = tiny_config("gemma4")
    text.pop("model_type")
    config = transformers.Gemma4Config(
        text_config=text, vision_config=None, audio_config=_audio_config(**audio),
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random (norm weights near 1), reproducibly
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            norm = name.endswith("norm.weight") or "layer_norm" in name or name.endswith(".norm.weight")
            attn = any(f"self_attn.{k}" in name for k in ("q_proj", "k_proj", "relative_k_proj"))
            p.copy_(1.0 + 0.1 * noise if norm else 0.1 * noise if ".conv." in name or "per_dim_scale" in name
                    else 0.3 * noise if attn else 0.05 * noise)  # attention logits well away from uniform
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
            elif name.endswith(("input_min", "input_max", "output_min", "output_max")):
                if "layers.1.self_attn.post." in name:
                    continue  # left at +-inf
                sign = -1.0 if name.endswith("_min") else 1.0
                scale = 1.5 if "input" in name else 2.0 if "self_attn.q_proj" in name or "k_proj" in name else 0.12
                b.copy_(sign * scale * (1.0 + torch.rand((), generator=gen)))
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<turn|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}},
        indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": MELS, "sampling_rate": RATE,
        "frame_length_ms": 20.0, "hop_length_ms": 10.0, "min_frequency": 0.0, "max_frequency": 8000.0,
        "mel_floor": 1e-3, "padding_value": 0.0, "return_attention_mask": True}, indent=2))
    return path


def reference_processor(path: str | Path) -> Any:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    fe = transformers.Gemma4AudioFeatureExtractor(feature_size=MELS)

    class Processor(transformers.Gemma4Processor):  # no video processor (it needs torchvision): audio only
        def check_argument_for_proper_class(self, name: str, arg: Any) -> None:
            if arg is not None:
                super().check_argument_for_proper_class(name, arg)

    return Processor(feature_extractor=fe, image_processor=transformers.Gemma4ImageProcessorPil(), tokenizer=tok,
                     video_processor=None, chat_template=CHAT_TEMPLATE)
