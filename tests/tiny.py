"""Tiny random checkpoints of every supported family, made with transformers (test-only helper).

    path = make_tiny_checkpoint("qwen3", tmp_path / "qwen3")     # config.json, model.safetensors,
                                                                 # tokenizer.json, tokenizer_config.json
Overrides are config fields (``num_key_value_heads=1``), plus three recognised extras:
``dtype="bfloat16"`` saves in that dtype, ``max_shard_size="20KB"`` shards the safetensors,
``seed=1`` changes the random weights (default 0). The tokenizer is a byte-level BPE trained on a
small built-in corpus to exactly ``vocab_size`` tokens, ids 0..2 = <|endoftext|>, <|im_start|>, <|im_end|>.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512, intermediate_size=128, max_position_embeddings=1024, rms_norm_eps=1e-5,
             bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "llama3": dict(model_type="llama", num_key_value_heads=4, head_dim=32, eos_token_id=[2, 0],
                   rope_scaling=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=128)),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=1, sliding_window=64),
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=4, head_dim=32),
    "phi3": dict(model_type="phi3", num_key_value_heads=4, head_dim=None, partial_rotary_factor=0.5,
                 original_max_position_embeddings=1024),
}
FAMILIES = tuple(CONFIGS)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = """The quick brown fox jumps over the lazy dog. Hello world! How are you today?
A decoder-only transformer predicts the next token from the tokens before it.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * 2)
Numbers like 12, 345 and 6789 appear in text; so do dates such as 2024-05-17.
The cache keeps keys and values of earlier positions so each step only computes one token.
Once upon a time there was a small model that wanted to speak many languages: bonjour, hola, hallo.
"""


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The config.json fields of a tiny `family` model (before transformers fills defaults)."""
    if family not in CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")
    config = {**_BASE, **CONFIGS[family], **overrides}
    return {k: v for k, v in config.items() if v is not None}


def make_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    filler = [f"<|extra_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_tokens(filler)  # a small corpus may run out of merges before vocab_size
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def _randomise(model: Any, seed: int) -> None:
    """Every parameter random (biases and norms too, so tests see them), reproducibly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)


def make_tiny_checkpoint(family: str, path: str | Path, **overrides: Any) -> Path:
    """Write a tiny random HF checkpoint of `family` (see FAMILIES) to `path` and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = overrides.pop("dtype", None)
    shard = overrides.pop("max_shard_size", None)
    seed = overrides.pop("seed", 0)
    fields = tiny_config(family, **overrides)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    make_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                  "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
                  "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path
