"""A tiny random Qwen2-Audio checkpoint with its tokenizer, chat template and processor files (test-only helper), and
transformers' own processor for it (the reference the tests compare with).

    path = make_tiny_qwen2_audio(tmp_path / "q2a")   # 32 mels, 2 encoder layers (1500 positions: 30 s), Qwen2 text
    processor = reference_processor(path)            # Qwen2AudioProcessor over WhisperFeatureExtractor, as saved

The chat template is Qwen2-Audio-Instruct's (as its checkpoints carry it: an audio part is a content dict with an
'audio' or 'audio_url' key): a default system turn, ChatML turns, an audio part written as
``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>`` and a newline. Clips: tiny_qwen3_asr.speech_like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tiny

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
VOCAB = 600
MELS = 32
RATE = 16000
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or message['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: "
    "<|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer() -> Any:
    text = "system user assistant You are a helpful assistant. Audio 1: 2: Detect the language and recognize the speech\n"
    return tiny.make_tokenizer(VOCAB, AUDIO_TOKENS, text)


def make_tiny_qwen2_audio(path: str | Path, seed: int = 0) -> Path:
    import torch
    import transformers

    path = Path(path)
    tok = make_tokenizer()
    text = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=2, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    audio = dict(model_type="qwen2_audio_encoder", num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=64, d_model=32, max_source_positions=1500)
    config = transformers.Qwen2AudioConfig(text_config=text, audio_config=audio,
                                           audio_token_index=tok.token_to_id("<|AUDIO|>"))
    config.eos_token_id, config.pad_token_id = 2, 0
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random (norm weights near 1), reproducibly
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            norm = "norm" in name and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if norm else 0.1 * noise if "conv" in name or "embed_positions" in name
                    else 0.05 * noise)
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tiny.save_chatml_tokenizer(tok, path, CHAT_TEMPLATE, audio_token="<|AUDIO|>", audio_bos_token="<|audio_bos|>",
                               audio_eos_token="<|audio_eos|>")
    fe = transformers.WhisperFeatureExtractor(feature_size=MELS, sampling_rate=RATE, return_attention_mask=True)
    fe.save_pretrained(path)  # preprocessor_config.json
    return path


def reference_processor(path: str | Path) -> Any:
    """transformers' Qwen2AudioProcessor over the saved tokenizer and feature extractor."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    fe = transformers.WhisperFeatureExtractor.from_pretrained(str(path))
    return transformers.Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=CHAT_TEMPLATE)
