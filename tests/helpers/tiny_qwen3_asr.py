"""A tiny random Qwen3-ASR checkpoint with its tokenizer, chat template and preprocessor config (test-only helper),
transformers' own processor for it (the reference the tests compare with), and speech-like synthetic clips.

    path = make_tiny_qwen3_asr(tmp_path / "asr")   # 32 mels, 2 encoder layers, windows of 2 chunks (2 s)
    processor = reference_processor(path)           # Qwen3ASRProcessor over Qwen3ASRFeatureExtractor
    clip = speech_like(2.3, seed=1)                 # chirps, noise bursts and silence at 16 kHz, float32
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import tiny

AUDIO_TOKENS = ["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
VOCAB = 600
MELS = 32
RATE = 16000
CHAT_TEMPLATE = (  # Qwen3-ASR's layout: turns in ChatML, an audio part as <|audio_start|><|audio_pad|><|audio_end|>
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'audio' %}"
    "<|audio_start|><|audio_pad|><|audio_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer() -> Any:
    # <asr_text> not special: transformers' parse reads it from the decoded text
    return tiny.make_tokenizer(VOCAB, AUDIO_TOKENS, "system user assistant language English Chinese transcribe\n",
                               added=["<asr_text>"])


def make_tiny_qwen3_asr(path: str | Path, seed: int = 0, **audio: Any) -> Path:
    """``audio``: audio_config fields over the tiny ones (n_window_infer=800: one window up to 8 s)."""
    import torch
    import transformers

    path = Path(path)
    tok = make_tokenizer()
    ids = {t: tok.token_to_id(t) for t in AUDIO_TOKENS}
    text = dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    audio_config = dict(num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                        n_window=50, n_window_infer=200, downsample_hidden_size=8, output_dim=64,
                        max_position_embeddings=13, **audio)
    config = transformers.Qwen3ASRConfig(text_config=text, audio_config=audio_config, audio_token_id=ids["<|audio_pad|>"],
                                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3ASRForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random (norm weights near 1), reproducibly
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            norm = "norm" in name and name.endswith("weight") or "layer_norm" in name or "ln_post" in name
            p.copy_(1.0 + 0.1 * noise if norm and name.endswith("weight") else 0.1 * noise if "conv2d" in name
                    else 0.05 * noise)
    model.save_pretrained(path)
    tiny.save_chatml_tokenizer(tok, path, CHAT_TEMPLATE, audio_token="<|audio_pad|>",
                               audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
    (path / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "Qwen3ASRFeatureExtractor", "feature_size": MELS, "sampling_rate": RATE,
        "hop_length": 160, "n_fft": 400, "n_window": 50, "min_length": 8000, "padding_value": 0.0,
        "return_attention_mask": True}, indent=2))
    return path


def reference_processor(path: str | Path) -> Any:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    fe = transformers.Qwen3ASRFeatureExtractor(feature_size=MELS)
    return transformers.Qwen3ASRProcessor(feature_extractor=fe, tokenizer=tok, chat_template=CHAT_TEMPLATE)


def speech_like(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """Float32 samples: syllable-like chirps (rising and falling tones with harmonics under an envelope), bursts
    of noise (fricatives) and gaps of silence, in a seeded random order."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * rate))
    out = np.zeros(n, np.float64)
    at = 0
    while at < n:
        kind = rng.choice(["chirp", "noise", "silence"], p=[0.5, 0.25, 0.25])
        length = min(n - at, int(rate * rng.uniform(0.05, 0.3)))
        t = np.arange(length) / rate
        if kind == "chirp":
            f0, f1 = rng.uniform(90, 300, size=2)
            phase = 2 * np.pi * (f0 * t + (f1 - f0) * t ** 2 / (2 * max(t[-1], 1e-3)))
            tone = sum(np.sin(k * phase) / k for k in range(1, 5))
            out[at:at + length] = 0.3 * tone * np.hanning(length)
        elif kind == "noise":
            out[at:at + length] = 0.1 * rng.standard_normal(length) * np.hanning(length)
        at += length
    return out.astype(np.float32)
