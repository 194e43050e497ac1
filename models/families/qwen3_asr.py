"""Qwen3-ASR: a Whisper-like audio encoder (AuT: three stride-2 Conv2d over 100-frame mel chunks, windowed
bidirectional attention) and a projector into a Qwen3 text model, whose audio placeholder rows take its embeddings.

    config.json  model_type qwen3_asr: ``audio_config`` (qwen3_asr_encoder: num_mel_bins, d_model, encoder_layers,
                 encoder_attention_heads, encoder_ffn_dim, downsample_hidden_size, n_window, n_window_infer,
                 output_dim); ``text_config`` a Qwen3 config (q/k norm); ``audio_token_id`` = <|audio_pad|>
    weights      model.audio_tower.*, model.multi_modal_projector.*, model.language_model.*, lm_head.*
    features     preprocessor_config.json (Qwen3ASRFeatureExtractor): 128 Slaney mels over a 400-point STFT,
                 hop 160 at 16 kHz, clips padded to min_length samples, frames to a multiple of 2 n_window

The text model is Qwen3's tables with ``ImageTokens(audio_token_id)``: the prefill graph's rows of embeddings
placed by position serve audio as they serve images (docs/features/audio.md). transformers' text model here is
plain Qwen3 (1-D RoPE): an audio token advances the position by one, as a text token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decodert.errors import DecodertError
from decodert.models.audio import AudioSpec, config_values, hf_audio_config, hf_audio_token, hf_encoder_sizes, hf_features, mel_settings
from decodert.models.families import qwen3
from decodert.models.families.qwen2_5_vl import text_config
from decodert.models.spec import ImageTokens, ModelSpec

MODEL_TYPES = ("qwen3_asr",)
TAGS = ("audio",)

HF_WEIGHTS = qwen3.HF_WEIGHTS
_A = "audio_tower."
_AL = _A + "layers.{i}."
_P = "multi_modal_projector."
AUDIO_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **{f"audio.conv{j}{b}": _A + f"conv2d{j}.{k}" for j in (1, 2, 3) for b, k in (("", "weight"), ("_bias", "bias"))},
    "audio.conv_out": _A + "conv_out.weight",
    "audio.layers.{i}.ln1": _AL + "self_attn_layer_norm.weight",
    "audio.layers.{i}.ln1_bias": _AL + "self_attn_layer_norm.bias",
    "audio.layers.{i}.qkv": tuple(_AL + f"self_attn.{x}_proj.weight" for x in "qkv"),
    "audio.layers.{i}.qkv_bias": tuple(_AL + f"self_attn.{x}_proj.bias" for x in "qkv"),
    "audio.layers.{i}.o": _AL + "self_attn.out_proj.weight",
    "audio.layers.{i}.o_bias": _AL + "self_attn.out_proj.bias",
    "audio.layers.{i}.ln2": _AL + "final_layer_norm.weight",
    "audio.layers.{i}.ln2_bias": _AL + "final_layer_norm.bias",
    "audio.layers.{i}.fc1": _AL + "fc1.weight",
    "audio.layers.{i}.fc1_bias": _AL + "fc1.bias",
    "audio.layers.{i}.fc2": _AL + "fc2.weight",
    "audio.layers.{i}.fc2_bias": _AL + "fc2.bias",
    "audio.ln_post": _A + "ln_post.weight",
    "audio.ln_post_bias": _A + "ln_post.bias",
    "audio.proj1": _P + "linear_1.weight",
    "audio.proj1_bias": _P + "linear_1.bias",
    "audio.proj2": _P + "linear_2.weight",
    "audio.proj2_bias": _P + "linear_2.bias",
}
HF_UNUSED = (r"audio_tower\..*", r"multi_modal_projector\..*")  # read by audio_tensor, not the text model
# transformers' Qwen3ASREncoderConfig defaults: a config.json lists only what differs
AUDIO_DEFAULTS: dict[str, Any] = dict(num_mel_bins=128, encoder_layers=24, encoder_attention_heads=16,
                                      encoder_ffn_dim=4096, d_model=1024, activation_function="gelu",
                                      scale_embedding=False, n_window=50, output_dim=3584, n_window_infer=800,
                                      downsample_hidden_size=480, max_position_embeddings=13)
# transformers' Qwen3ASRFeatureExtractor defaults (preprocessor_config.json lists what differs); f_max is fixed at 8 kHz
FEATURE_DEFAULTS: dict[str, Any] = dict(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                        n_window=50, min_length=8000, dither=0.0)


def sanitize(key: str) -> str | None:
    """transformers' names -> the tables' (model.language_model.* -> model.*, model.audio_tower.* -> audio_tower.*)."""
    for new, old in (("model.language_model.", "model."), ("model.audio_tower.", "audio_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def spec_from_hf(config: dict) -> ModelSpec:
    text = text_config(config)
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", True)  # Qwen3ASRConfig's default
    token = hf_audio_token(config, ("audio_token_id",), 151676, "qwen3_asr")
    return dataclasses.replace(qwen3.spec_from_hf(text), family="qwen3_asr", images=ImageTokens(token))


def audio_from_hf(config: dict) -> AudioSpec:
    a = hf_audio_config(config, AUDIO_DEFAULTS)
    text = text_config(config)
    if int(a["output_dim"]) != int(text["hidden_size"]):
        raise DecodertError(f"config.json: audio_config output_dim {a['output_dim']} differs from the text "
                            f"hidden_size {text['hidden_size']}")
    with config_values():  # AuT: its own convolution width, chunks of 2 n_window frames in windows
        return AudioSpec(**hf_encoder_sizes(a), conv_channels=int(a["downsample_hidden_size"]),
                         out_hidden=int(a["output_dim"]), n_window=int(a["n_window"]),
                         n_window_infer=int(a["n_window_infer"]), max_positions=int(a["max_position_embeddings"]))


def audio_features(preprocessor: dict, audio: AudioSpec) -> dict[str, Any]:
    """The log-mel settings (runtime/audio/features.py MelSettings) of preprocessor_config.json, checked against
    the encoder. Qwen3ASRProcessor pads a single clip to itself (no 30 s padding) and the frames to 2 n_window."""
    f = hf_features(preprocessor, FEATURE_DEFAULTS, audio)
    if int(f["n_window"]) != audio.n_window or audio.n_window != 50:
        raise DecodertError(f"n_window {f['n_window']} (encoder {audio.n_window}): Qwen3ASRProcessor counts 13 "
                            "tokens per chunk, which holds for n_window 50 only")
    return mel_settings(f, min_samples=int(f["min_length"]), frame_multiple=2 * int(f["n_window"]))
