"""A tiny random Whisper checkpoint (WhisperForConditionalGeneration) with a byte-level BPE tokenizer holding
Whisper's special tokens, its generation_config (forced prompt, suppress_tokens) and preprocessor config
(test-only helper), and transformers' own WhisperFeatureExtractor for it (the reference the tests compare with).

    path = make_tiny_whisper(tmp_path / "whisper")   # 80 mels, 2 + 2 layers, d_model 32, 30 s windows
    fe = reference_extractor()                       # WhisperFeatureExtractor(feature_size=80)

The vocabulary: the BPE pieces, then <|endoftext|> (eos and pad), <|startoftranscript|>, two languages, the two tasks,
<|startoflm|>, <|startofprev|>, <|nocaptions|> and <|notimestamps|> last (no timestamp tokens: a no-timestamp
run's long-form segments are then whole windows, as the tests need). ``timestamps=True`` adds Whisper's 1501
timestamp tokens <|0.00|> .. <|30.00|> after <|notimestamps|> (timestamp_begin = no_timestamps_token_id + 1) and
max_initial_timestamp_index to the generation config; ``timestamp_scale`` multiplies their rows of proj_out, so that
a random model emits timestamps as often as a test needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny import _CORPUS

MELS = 80
RATE = 16000
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
BPE = 300


def timestamp_tokens() -> list[str]:
    return [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def make_tokenizer(timestamps: bool = False) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    extra = timestamp_tokens() if timestamps else []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS + extra])
    return tok


def make_tiny_whisper(path: str | Path, seed: int = 0, noise: float = 0.2, timestamps: bool = False,
                      timestamp_scale: float = 1.0, max_initial_timestamp_index: int | None = 50,
                      **config: Any) -> Path:
    """``noise``: the weights' random scale (0.2 for the tiny shapes; wide models want ~0.02, else their fp32
    logits carry errors of ~0.1 and greedy near-ties flip between runtimes); ``timestamps``: the timestamp tokens
    (their proj_out rows times ``timestamp_scale``); ``config``: WhisperConfig fields."""
    import torch
    import transformers

    path = Path(path)
    tok = make_tokenizer(timestamps)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    vocab = tok.get_vocab_size()
    eos = ids["<|endoftext|>"]
    settings = dict(vocab_size=vocab, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    max_source_positions=1500, max_target_positions=96, decoder_start_token_id=ids["<|startoftranscript|>"],
                    eos_token_id=eos, pad_token_id=eos, bos_token_id=eos, scale_embedding=False,
                    tie_word_embeddings=False)
    cfg = transformers.WhisperConfig(**{**settings, **config})
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    scale = noise
    with torch.no_grad():  # every parameter random (norm weights near 1), reproducibly
        for name, p in model.named_parameters():
            if "embed_positions" in name and "encoder" in name:
                continue  # the encoder's sinusoid table (fixed in transformers)
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            norm = "layer_norm" in name
            p.copy_(1.0 + 0.1 * noise if norm and name.endswith("weight") else scale * noise)
        if timestamps:
            model.proj_out.weight[ids["<|notimestamps|>"] + 1:] *= timestamp_scale
    g = model.generation_config
    g.decoder_start_token_id = ids["<|startoftranscript|>"]
    g.eos_token_id = g.pad_token_id = eos
    g.lang_to_id = {"<|en|>": ids["<|en|>"], "<|de|>": ids["<|de|>"]}
    g.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    g.is_multilingual = True
    g.no_timestamps_token_id = ids["<|notimestamps|>"]
    g.suppress_tokens = [5, 17, 40, ids["<|startoflm|>"], ids["<|startofprev|>"], ids["<|nocaptions|>"]]
    g.begin_suppress_tokens = [3, eos]
    g.max_length = cfg.max_target_positions
    if timestamps:
        g.max_initial_timestamp_index = max_initial_timestamp_index
    g.forced_decoder_ids = None
    g._from_model_config = False  # from_pretrained then reads this file, not the model config
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False}, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": MELS, "sampling_rate": RATE,
        "hop_length": 160, "n_fft": 400, "chunk_length": 30, "n_samples": 30 * RATE, "nb_max_frames": 3000,
        "padding_value": 0.0, "return_attention_mask": False}, indent=2))
    return path


def reference_extractor() -> Any:
    import transformers

    return transformers.WhisperFeatureExtractor(feature_size=MELS)
