"""Qwen2-Audio (Qwen2AudioForConditionalGeneration): Whisper's encoder over one 30 s log-mel window, average-pooled by
2, a LayerNorm and one linear projector into a Qwen2 text model, whose ``<|AUDIO|>`` placeholder rows take the
audio embeddings.

    config.json  model_type qwen2_audio: ``audio_config`` (qwen2_audio_encoder: num_mel_bins, d_model, encoder_layers,
                 encoder_attention_heads, encoder_ffn_dim, max_source_positions 1500); ``text_config`` a Qwen2
                 config; ``audio_token_index`` = <|AUDIO|>
    weights      audio_tower.*, multi_modal_projector.linear.*, language_model.model.*, language_model.lm_head.*
                 (as the hub's checkpoints and transformers' save_pretrained store them; model.language_model.* too)
    features     preprocessor_config.json (WhisperFeatureExtractor): Slaney mels over a 400-point STFT, hop 160 at
                 16 kHz, every clip zero-padded to 30 s (Qwen2AudioProcessor: padding="max_length")

The encoder is the ``whisper`` kind of models/audio.py (export/lowering/audio/whisper.py). Qwen2AudioProcessor
expands ``<|AUDIO|>`` to ((l - 1) // 2 + 1 - 2) // 2 + 1 tokens for l valid mel frames (``AudioSpec.tokens``); the
text model is plain Qwen2 (1-D RoPE, q/k/v biases): an audio token advances the position by one.

Transcription: Qwen2-Audio has no fixed transcription prompt. ``LLM.transcribe`` asks in a user turn with the clip
and ``TRANSCRIPTION["instruction"]``, the speech-recognition instruction of Qwen2-Audio's own evaluation ("Detect
the language and recognize the speech:"), and returns the answer as it is (runtime/audio/transcribe.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decodert.errors import DecodertError
from decodert.models.audio import AudioSpec, config_values, hf_audio_config, hf_audio_token, hf_encoder_sizes, hf_features, mel_settings
from decodert.models.families import qwen2
from decodert.models.families.qwen2_5_vl import text_config
from decodert.models.spec import ImageTokens, ModelSpec

MODEL_TYPES = ("qwen2_audio",)
TAGS = ("audio",)

HF_WEIGHTS = qwen2.HF_WEIGHTS
_A = "audio_tower."
_AL = _A + "layers.{i}."
AUDIO_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **{f"audio.conv{j}{b}": _A + f"conv{j}.{k}" for j in (1, 2) for b, k in (("", "weight"), ("_bias", "bias"))},
    "audio.positions": _A + "embed_positions.weight",
    "audio.layers.{i}.ln1": _AL + "self_attn_layer_norm.weight",
    "audio.layers.{i}.ln1_bias": _AL + "self_attn_layer_norm.bias",
    **{f"audio.layers.{{i}}.{x}": _AL + f"self_attn.{x}_proj.weight" for x in "qkv"},
    "audio.layers.{i}.q_bias": _AL + "self_attn.q_proj.bias",
    "audio.layers.{i}.v_bias": _AL + "self_attn.v_proj.bias",  # k_proj has no bias (Whisper's attention)
    "audio.layers.{i}.o": _AL + "self_attn.out_proj.weight",
    "audio.layers.{i}.o_bias": _AL + "self_attn.out_proj.bias",
    "audio.layers.{i}.ln2": _AL + "final_layer_norm.weight",
    "audio.layers.{i}.ln2_bias": _AL + "final_layer_norm.bias",
    "audio.layers.{i}.fc1": _AL + "fc1.weight",
    "audio.layers.{i}.fc1_bias": _AL + "fc1.bias",
    "audio.layers.{i}.fc2": _AL + "fc2.weight",
    "audio.layers.{i}.fc2_bias": _AL + "fc2.bias",
    "audio.ln_post": _A + "layer_norm.weight",
    "audio.ln_post_bias": _A + "layer_norm.bias",
    "audio.proj": "multi_modal_projector.linear.weight",
    "audio.proj_bias": "multi_modal_projector.linear.bias",
}
HF_UNUSED = (r"audio_tower\..*", r"multi_modal_projector\..*")  # read by audio_tensor, not the text model
# transformers' Qwen2AudioEncoderConfig defaults as Qwen2AudioConfig sets them (a config.json lists what differs)
AUDIO_DEFAULTS: dict[str, Any] = dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20,
                                      encoder_ffn_dim=5120, d_model=1280, activation_function="gelu",
                                      scale_embedding=False, max_source_positions=1500)
# transformers' WhisperFeatureExtractor defaults (preprocessor_config.json lists what differs); f_max is 8 kHz
FEATURE_DEFAULTS: dict[str, Any] = dict(feature_size=80, sampling_rate=16000, hop_length=160, n_fft=400,
                                        chunk_length=30, dither=0.0)
TRANSCRIPTION = {"instruction": "Detect the language and recognize the speech:"}


def sanitize(key: str) -> str | None:
    """Stored names -> the tables' (language_model.model.* -> model.*, language_model.lm_head -> lm_head, and
    transformers 5's model.language_model.* / model.audio_tower.* / model.multi_modal_projector.*)."""
    for new, old in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model."), ("model.audio_tower.", "audio_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def spec_from_hf(config: dict) -> ModelSpec:
    text = text_config(config)
    token = hf_audio_token(config, ("audio_token_index", "audio_token_id"), 151646, "qwen2_audio")
    return dataclasses.replace(qwen2.spec_from_hf(text), family="qwen2_audio", images=ImageTokens(token))


def audio_from_hf(config: dict) -> AudioSpec:
    a = hf_audio_config(config, AUDIO_DEFAULTS)
    with config_values():  # Whisper's encoder: the convolutions as wide as the model
        return AudioSpec(**hf_encoder_sizes(a), conv_channels=int(a["d_model"]),
                         out_hidden=int(text_config(config)["hidden_size"]),
                         max_positions=int(a["max_source_positions"]), encoder="whisper")


def audio_features(preprocessor: dict, audio: AudioSpec) -> dict[str, Any]:
    """The log-mel settings (runtime/audio/features.py MelSettings) of preprocessor_config.json, checked against
    the encoder: every clip padded to the window (``pad_to``: chunk_length seconds of samples, 2 max_positions frames)."""
    f = hf_features(preprocessor, FEATURE_DEFAULTS, audio)
    window = int(f["chunk_length"]) * int(f["sampling_rate"])
    if window // int(f["hop_length"]) != audio.window_frames:
        raise DecodertError(f"chunk_length {f['chunk_length']} s makes {window // int(f['hop_length'])} mel frames; "
                            f"the encoder reads {audio.window_frames} (2 max_source_positions)")
    return mel_settings(f, pad_to=window)
