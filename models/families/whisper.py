"""Whisper (WhisperForConditionalGeneration): an encoder-decoder speech model. The encoder reads 30 s of log-mel
(two Conv1d + GELU, sinusoid positions, pre-LayerNorm bidirectional layers); the decoder (learned positions,
pre-LayerNorm layers of causal self-attention, cross-attention over the encoder output and a GELU MLP) writes
the text after a forced prompt.

    config.json            model_type whisper: d_model, encoder_/decoder_ layers, attention_heads, ffn_dim,
                           num_mel_bins, max_source_positions (1500 encoder rows = 3000 mel frames), max_target_positions
    generation_config.json decoder_start_token_id (<|startoftranscript|>), lang_to_id, task_to_id,
                           no_timestamps_token_id, suppress_tokens, begin_suppress_tokens, is_multilingual,
                           max_initial_timestamp_index (the timestamp rules)
    preprocessor_config    WhisperFeatureExtractor: n_fft 400, hop 160, feature_size mels, 30 s windows
    weights                model.encoder.*, model.decoder.*, proj_out.weight (tied to embed_tokens by default)

Attention projections: q and v carry a bias, k none (transformers' WhisperAttention); q is scaled by D^-0.5.
The graphs: export/seq2seq_export.py (ENCODER_DECODER), the runtime: runtime/audio/whisper.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from decodert.errors import DecodertError

MODEL_TYPES = ("whisper",)
ENCODER_DECODER = True


@dataclass(frozen=True)
class WhisperSpec:
    """The sizes of a Whisper checkpoint (config.json), resolved once."""

    vocab_size: int
    d_model: int  # C
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn: int
    decoder_ffn: int
    num_mel_bins: int  # M
    max_source_positions: int  # T: encoder rows of one window (mel frames / 2)
    max_target_positions: int  # the decoder's learned positions (its longest sequence)
    scale_embedding: bool = False  # token embeddings x sqrt(C)
    tie_word_embeddings: bool = True  # logits over embed_tokens (proj_out tied)
    layer_norm_eps: float = 1e-5
    family: str = "whisper"

    @property
    def num_layers(self) -> int:  # the decoder's (the cache's) layers
        return self.decoder_layers

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_heads

    @property
    def window_frames(self) -> int:
        """Mel frames of one encoder window (3000 for 30 s)."""
        return 2 * self.max_source_positions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WhisperSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# transformers' WhisperConfig defaults (config.json lists what differs)
DEFAULTS: dict[str, Any] = dict(vocab_size=51865, num_mel_bins=80, encoder_layers=4, encoder_attention_heads=6,
                                decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536, encoder_ffn_dim=1536,
                                d_model=384, scale_embedding=False, max_source_positions=1500,
                                max_target_positions=448, activation_function="gelu", tie_word_embeddings=True)


def spec_from_hf(config: dict) -> WhisperSpec:
    c = {**DEFAULTS, **config}
    if c["activation_function"] != "gelu":
        raise DecodertError(f"config.json: activation_function '{c['activation_function']}' is not supported (gelu)")
    spec = WhisperSpec(vocab_size=int(c["vocab_size"]), d_model=int(c["d_model"]),
                       encoder_layers=int(c["encoder_layers"]), decoder_layers=int(c["decoder_layers"]),
                       encoder_heads=int(c["encoder_attention_heads"]), decoder_heads=int(c["decoder_attention_heads"]),
                       encoder_ffn=int(c["encoder_ffn_dim"]), decoder_ffn=int(c["decoder_ffn_dim"]),
                       num_mel_bins=int(c["num_mel_bins"]), max_source_positions=int(c["max_source_positions"]),
                       max_target_positions=int(c["max_target_positions"]), scale_embedding=bool(c["scale_embedding"]),
                       tie_word_embeddings=bool(c["tie_word_embeddings"]))
    for heads in (spec.encoder_heads, spec.decoder_heads):
        if spec.d_model % heads:
            raise DecodertError(f"config.json: d_model {spec.d_model} is not divisible by {heads} attention heads")
    return spec


_E, _D = "model.encoder.", "model.decoder."
_EL, _DL = _E + "layers.{i}.", _D + "layers.{i}."


def _attention(canon: str, hf: str) -> dict[str, str]:
    """q | v with a bias, k without; the output projection with one."""
    return {canon + "q": hf + "q_proj.weight", canon + "q_bias": hf + "q_proj.bias", canon + "k": hf + "k_proj.weight",
            canon + "v": hf + "v_proj.weight", canon + "v_bias": hf + "v_proj.bias",
            canon + "o": hf + "out_proj.weight", canon + "o_bias": hf + "out_proj.bias"}


def _norm(canon: str, hf: str) -> dict[str, str]:
    return {canon: hf + ".weight", canon + "_bias": hf + ".bias"}


def _mlp(canon: str, hf: str) -> dict[str, str]:
    return {canon + "fc1": hf + "fc1.weight", canon + "fc1_bias": hf + "fc1.bias",
            canon + "fc2": hf + "fc2.weight", canon + "fc2_bias": hf + "fc2.bias"}


# canonical name -> checkpoint key; "enc.*" the encoder's, "dec.*" the decoder's ({i}: the layer)
ENCODER_WEIGHTS: dict[str, str] = {
    "enc.conv1": _E + "conv1.weight", "enc.conv1_bias": _E + "conv1.bias",  # [C, M, 3]
    "enc.conv2": _E + "conv2.weight", "enc.conv2_bias": _E + "conv2.bias",  # [C, C, 3] stride 2
    "enc.positions": _E + "embed_positions.weight",  # [T, C] sinusoids
    **_norm("enc.layers.{i}.ln1", _EL + "self_attn_layer_norm"), **_attention("enc.layers.{i}.", _EL + "self_attn."),
    **_norm("enc.layers.{i}.ln2", _EL + "final_layer_norm"), **_mlp("enc.layers.{i}.", _EL),
    **_norm("enc.norm", _E + "layer_norm"),
}
DECODER_WEIGHTS: dict[str, str] = {
    "dec.embed": _D + "embed_tokens.weight",  # [V, C]
    "dec.positions": _D + "embed_positions.weight",  # [max_target_positions, C] learned
    **_norm("dec.layers.{i}.ln1", _DL + "self_attn_layer_norm"), **_attention("dec.layers.{i}.", _DL + "self_attn."),
    **_norm("dec.layers.{i}.lnx", _DL + "encoder_attn_layer_norm"),
    **_attention("dec.layers.{i}.x", _DL + "encoder_attn."),  # xq, xk, xv, xo: cross-attention
    **_norm("dec.layers.{i}.ln2", _DL + "final_layer_norm"), **_mlp("dec.layers.{i}.", _DL),
    **_norm("dec.norm", _D + "layer_norm"),
    "dec.lm_head": "proj_out.weight",  # [V, C]; absent (tied): dec.embed
}
HF_WEIGHTS: dict[str, str] = {**ENCODER_WEIGHTS, **DECODER_WEIGHTS}

# transformers' WhisperFeatureExtractor defaults (preprocessor_config.json lists what differs); f_max is 8 kHz
FEATURE_DEFAULTS: dict[str, Any] = dict(feature_size=80, sampling_rate=16000, hop_length=160, n_fft=400,
                                        chunk_length=30, dither=0.0)


def window_features(preprocessor: dict, spec: WhisperSpec) -> dict[str, Any]:
    """The log-mel settings (runtime/audio/features.py MelSettings) of preprocessor_config.json, checked against
    the encoder, and ``window_samples``: a window's samples (30 s), the padding of a clip no longer than it."""
    f = {**FEATURE_DEFAULTS, **{k: v for k, v in preprocessor.items() if k in FEATURE_DEFAULTS}}
    if int(f["feature_size"]) != spec.num_mel_bins:
        raise DecodertError(f"feature_size {f['feature_size']} differs from the encoder's {spec.num_mel_bins} mel bins")
    if float(f["dither"]):
        raise DecodertError("dither adds random noise to the features; a checkpoint with dither 0 is supported")
    window = int(f["chunk_length"]) * int(f["sampling_rate"])
    if window // int(f["hop_length"]) != spec.window_frames:
        raise DecodertError(f"chunk_length {f['chunk_length']} s makes {window // int(f['hop_length'])} mel frames; "
                            f"the encoder reads {spec.window_frames} (2 max_source_positions)")
    return dict(sampling_rate=int(f["sampling_rate"]), n_fft=int(f["n_fft"]), hop_length=int(f["hop_length"]),
                n_mels=int(f["feature_size"]), f_min=0.0, f_max=8000.0, window_samples=window)


def generation(config: dict, gen: dict) -> dict[str, Any]:
    """generation_config.json -> the forced prompt's parts, the suppressed tokens and the timestamp rules' cap on
    the first timestamp (runtime/audio/whisper.py, runtime/audio/timestamps.py)."""
    g = {**config, **gen}
    start = g.get("decoder_start_token_id")
    eos = g.get("eos_token_id")
    if not isinstance(start, int) or not isinstance(eos, int):
        raise DecodertError("generation_config.json: a whisper model needs integer decoder_start_token_id and "
                            "eos_token_id")
    ids = lambda key: [int(t) for t in (g.get(key) or [])]  # noqa: E731
    return dict(decoder_start_token_id=start, eos_token_id=eos,
                lang_to_id={str(k): int(v) for k, v in (g.get("lang_to_id") or {}).items()},
                task_to_id={str(k): int(v) for k, v in (g.get("task_to_id") or {}).items()},
                no_timestamps_token_id=g.get("no_timestamps_token_id"),
                max_initial_timestamp_index=g.get("max_initial_timestamp_index"),
                is_multilingual=g.get("is_multilingual"),
                suppress_tokens=ids("suppress_tokens"), begin_suppress_tokens=ids("begin_suppress_tokens"),
                max_length=int(g.get("max_length") or g.get("max_target_positions") or 448))
