"""The frozen description of an audio encoder + projector (``audio.onnx``), beside the text ``ModelSpec``.

An audio-language family (models/families/qwen3_asr.py) declares ``audio_from_hf(config) -> AudioSpec``,
``AUDIO_WEIGHTS`` (canonical audio name -> checkpoint key) and ``audio_features(preprocessor_config)`` (the
log-mel settings, runtime/audio/features.py); the Whisper-like families (qwen2_audio, qwen3_asr) read their
configs through the helpers at the end of this file (``hf_audio_config``, ``hf_features``, ...). The text model's
``ModelSpec.images`` names the audio token: its rows are replaced by the audio embeddings in prefill exactly as
image rows are (the prefill graph's ``image_embeds`` / ``image_positions`` carry any encoder's rows;
export/lowering/graph.py).

The ``qwen3_asr`` encoder (Qwen3-ASR's AuT: Whisper-like, over chunks of 2 n_window mel frames) names:

- ``audio.conv{1,2,3}[_bias]``   [D_c, 1|D_c, 3, 3] / [D_c]   Conv2d stride 2, padding 1, each then GELU (erf)
- ``audio.conv_out``             [C_a, D_c * F']             the flattened (channel, mel) axis -> C_a, no bias
- ``audio.layers.{i}.ln1[_bias]``, ``.qkv[_bias]`` [3 C_a, C_a] (q|k|v fused at load), ``.o[_bias]``,
  ``.ln2[_bias]``, ``.fc1[_bias]`` [I_a, C_a], ``.fc2[_bias]`` [C_a, I_a]
- ``audio.ln_post[_bias]`` [C_a];  ``audio.proj1[_bias]`` [C_a, C_a];  ``audio.proj2[_bias]`` [hidden, C_a]

The ``whisper`` encoder (Qwen2-Audio's: Whisper's encoder over one 30 s window, average-pooled by 2) names:

- ``audio.conv1[_bias]``         [C_a, M, 3] / [C_a]         Conv1d padding 1, then GELU
- ``audio.conv2[_bias]``         [C_a, C_a, 3] / [C_a]       Conv1d stride 2, padding 1, then GELU
- ``audio.positions``            [T, C_a]                    the position table (T = max_positions rows, 1500)
- ``audio.layers.{i}.ln1[_bias]``, ``.q[_bias]``, ``.k`` (no bias), ``.v[_bias]``, ``.o[_bias]`` [C_a, C_a],
  ``.ln2[_bias]``, ``.fc1[_bias]``, ``.fc2[_bias]``
- ``audio.ln_post[_bias]`` [C_a] (after the pooling);  ``audio.proj[_bias]`` [hidden, C_a]

The ``gemma4`` encoder (Gemma 4's conformer) has its own frozen spec and names: models/audio_conformer.py
``ConformerSpec``.

Each kind declares its spec, names, shapes, token count and stored dtypes in the tables at the end (``KINDS``;
``audio_spec`` reads a manifest's spec dict by its ``encoder``, a dict without one being ``qwen3_asr``'s): the export
(export/lowering/audio/graph.py) and the runtime (runtime/audio/encoder.py) dispatch on the spec's ``encoder`` the
same way. Whisper itself is an encoder-decoder family with its own spec
(models/families/whisper.py ``WhisperSpec``, ``ENCODER_DECODER``), not an encoder feeding a decoder-only text model.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from decodert.errors import DecodertError
from decodert.models.audio_conformer import ConformerSpec, conformer_dtype, conformer_names, conformer_shape


def post_conv(frames: int) -> int:
    """Frames after three (kernel 3, stride 2, padding 1) convolutions; none stays none."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


@dataclass(frozen=True)
class AudioSpec:
    """An audio encoder over log-mel chunks and the projector into the text model's hidden size."""

    num_mel_bins: int
    hidden_size: int  # C_a
    intermediate_size: int  # I_a
    num_layers: int
    num_heads: int
    conv_channels: int  # D_c
    out_hidden: int  # the text model's hidden size
    n_window: int = 50  # a chunk is 2 n_window mel frames
    n_window_infer: int = 800  # attention windows span n_window_infer mel frames (whole chunks)
    max_positions: int = 13  # rows of the sinusoid position table (>= tokens per chunk)
    layer_norm_eps: float = 1e-5
    encoder: str = "qwen3_asr"  # the encoder kind (KINDS): "qwen3_asr" (Qwen3-ASR), "whisper" (Qwen2-Audio)

    def __post_init__(self) -> None:
        mine = [k for k, kind in KINDS.items() if kind.spec is AudioSpec]
        if self.encoder not in mine:
            raise ValueError(f"audio encoder '{self.encoder}' is not one of {', '.join(mine)}")
        if self.hidden_size % self.num_heads or self.hidden_size % 2:
            raise ValueError(f"audio d_model {self.hidden_size} must be even and divisible by its {self.num_heads} heads")
        KINDS[self.encoder].check(self)

    def _check_chunks(self) -> None:
        """Qwen3-ASR's chunks and windows."""
        if self.n_window <= 0 or self.n_window_infer % (2 * self.n_window):
            raise ValueError(f"audio n_window_infer {self.n_window_infer} must be a multiple of 2 n_window "
                             f"({2 * self.n_window})")
        if self.chunk_tokens > self.max_positions:
            raise ValueError(f"a chunk of {self.chunk_frames} mel frames makes {self.chunk_tokens} tokens, more than "
                             f"the {self.max_positions} rows of the position table")

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    @property
    def chunk_tokens(self) -> int:
        """Encoder rows of one full chunk (13 for 100 frames)."""
        return post_conv(self.chunk_frames)

    @property
    def window_chunks(self) -> int:
        """Chunks per attention window."""
        return self.n_window_infer // self.chunk_frames

    @property
    def mel_out(self) -> int:
        """Mel bins after the three stride-2 convolutions (F')."""
        return post_conv(self.num_mel_bins)

    @property
    def window_frames(self) -> int:
        """Mel frames the ``whisper`` encoder reads at most (2 max_positions: 3000, 30 s)."""
        return 2 * self.max_positions

    def tokens(self, frames: int) -> int:
        """Audio tokens of a clip of ``frames`` valid mel frames (its processor's count)."""
        return KINDS[self.encoder].tokens(self, frames)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AudioSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def audio_spec(d: dict[str, Any]) -> Any:
    """A manifest's audio spec dict -> the spec of its encoder kind (an AudioSpec or a kind's own)."""
    kind = d.get("encoder", "qwen3_asr")
    if kind not in KINDS:
        raise ValueError(f"audio encoder '{kind}' is not one of {', '.join(KINDS)}")
    return KINDS[kind].spec.from_dict(d)


def audio_names(a: Any) -> list[str]:
    """Canonical audio weight names of the encoder ``a``, in weights.bin order."""
    return KINDS[a.encoder].names(a)


def audio_shape(a: Any, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical audio weight of the encoder ``a``."""
    return KINDS[a.encoder].shape(a, name)


def audio_dtype(a: Any, name: str, dtype: str) -> str:
    """The dtype weights.bin stores audio weight ``name`` in: the graph's ``dtype`` unless the kind keeps it."""
    return KINDS[a.encoder].dtype(a, name, dtype)


def _chunk_tokens(a: AudioSpec, frames: int) -> int:
    """Qwen3ASRProcessor's count: 13 a full chunk, post_conv of the last one's frames."""
    full, rest = divmod(frames, a.chunk_frames)
    return full * a.chunk_tokens + post_conv(rest)


def _qwen3_asr_names(a: AudioSpec) -> list[str]:
    names = [f"audio.conv{j}{b}" for j in (1, 2, 3) for b in ("", "_bias")] + ["audio.conv_out"]
    for i in range(a.num_layers):
        p = f"audio.layers.{i}."
        names += [p + n for n in ("ln1", "ln1_bias", "qkv", "qkv_bias", "o", "o_bias", "ln2", "ln2_bias",
                                  "fc1", "fc1_bias", "fc2", "fc2_bias")]
    return names + ["audio.ln_post", "audio.ln_post_bias", "audio.proj1", "audio.proj1_bias", "audio.proj2",
                    "audio.proj2_bias"]


def _qwen3_asr_shape(a: AudioSpec, name: str) -> tuple[int, ...]:
    c, inter, d = a.hidden_size, a.intermediate_size, a.conv_channels
    leaf = name.rsplit(".", 1)[-1]
    shapes = {"conv1": (d, 1, 3, 3), "conv2": (d, d, 3, 3), "conv3": (d, d, 3, 3), "conv1_bias": (d,),
              "conv2_bias": (d,), "conv3_bias": (d,), "conv_out": (c, d * a.mel_out), "qkv": (3 * c, c),
              "qkv_bias": (3 * c,), "o": (c, c), "fc1": (inter, c), "fc1_bias": (inter,), "fc2": (c, inter),
              "proj1": (c, c), "proj1_bias": (c,), "proj2": (a.out_hidden, c), "proj2_bias": (a.out_hidden,)}
    return shapes.get(leaf, (c,))


def whisper_rows(frames: int) -> int:
    """Encoder rows of ``frames`` valid mel frames after the stride-2 Conv1d: (frames - 1) // 2 + 1."""
    return (frames - 1) // 2 + 1 if frames > 0 else 0


def _pooled_tokens(a: AudioSpec, frames: int) -> int:
    """Qwen2AudioProcessor's count: the encoder's valid rows, average-pooled by 2 ((rows - 2) // 2 + 1)."""
    return (whisper_rows(min(frames, a.window_frames)) - 2) // 2 + 1


def _whisper_names(a: AudioSpec) -> list[str]:
    names = ["audio.conv1", "audio.conv1_bias", "audio.conv2", "audio.conv2_bias", "audio.positions"]
    for i in range(a.num_layers):
        p = f"audio.layers.{i}."
        names += [p + n for n in ("ln1", "ln1_bias", "q", "q_bias", "k", "v", "v_bias", "o", "o_bias", "ln2",
                                  "ln2_bias", "fc1", "fc1_bias", "fc2", "fc2_bias")]
    return names + ["audio.ln_post", "audio.ln_post_bias", "audio.proj", "audio.proj_bias"]


def _whisper_shape(a: AudioSpec, name: str) -> tuple[int, ...]:
    c, inter = a.hidden_size, a.intermediate_size
    leaf = name.rsplit(".", 1)[-1]
    shapes = {"conv1": (c, a.num_mel_bins, 3), "conv2": (c, c, 3), "positions": (a.max_positions, c),
              "q": (c, c), "k": (c, c), "v": (c, c), "o": (c, c), "fc1": (inter, c), "fc1_bias": (inter,),
              "fc2": (c, inter), "proj": (a.out_hidden, c), "proj_bias": (a.out_hidden,)}
    return shapes.get(leaf, (c,))


@dataclass(frozen=True)
class EncoderKind:
    """What an encoder kind declares: its weights' names and shapes, its audio tokens per clip, its checks, its
    spec's type and the dtype weights.bin stores each weight in."""

    names: Callable[[Any], list[str]]
    shape: Callable[[Any, str], tuple[int, ...]]
    tokens: Callable[[Any, int], int]  # (spec, valid mel frames) -> audio tokens
    check: Callable[[Any], None] = lambda a: None  # an AudioSpec's own checks (a kind's own spec checks itself)
    spec: type = AudioSpec  # the frozen spec of the kind (.from_dict(manifest.audio.spec))
    dtype: Callable[[Any, str, str], str] = lambda a, name, dtype: dtype  # (spec, name, graph dtype) -> stored


KINDS: dict[str, EncoderKind] = {
    "qwen3_asr": EncoderKind(_qwen3_asr_names, _qwen3_asr_shape, _chunk_tokens, AudioSpec._check_chunks),
    "whisper": EncoderKind(_whisper_names, _whisper_shape, _pooled_tokens),
    "gemma4": EncoderKind(conformer_names, conformer_shape, ConformerSpec.tokens, spec=ConformerSpec,
                          dtype=conformer_dtype),
}
ENCODERS = tuple(KINDS)


# ---- what the Whisper-like families (qwen2_audio, qwen3_asr) read from config.json and preprocessor_config.json alike


def hf_audio_token(config: dict, names: tuple[str, ...], default: int, family: str) -> int:
    """The audio placeholder's id: config.json's first key of ``names`` there, else ``default``; an integer."""
    token = next((config[n] for n in names if n in config), default)
    if not isinstance(token, int):
        raise DecodertError(f"config.json: a {family} model needs an integer '{names[0]}'")
    return token


def hf_audio_config(config: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``audio_config`` over the family's defaults (transformers' encoder config: a config.json lists
    what differs), refused in one line unless the encoder runs GELU over unscaled embeddings."""
    a = {**defaults, **(config.get("audio_config") or {})}
    if a["activation_function"] != "gelu" or a["scale_embedding"]:
        raise DecodertError(f"config.json: audio_config activation_function '{a['activation_function']}' / "
                            "scale_embedding is not supported (gelu, unscaled)")
    return a


def hf_encoder_sizes(a: dict[str, Any]) -> dict[str, int]:
    """The AudioSpec fields an ``audio_config`` names the Whisper way (d_model, encoder_layers, ...)."""
    return dict(num_mel_bins=int(a["num_mel_bins"]), hidden_size=int(a["d_model"]),
                intermediate_size=int(a["encoder_ffn_dim"]), num_layers=int(a["encoder_layers"]),
                num_heads=int(a["encoder_attention_heads"]))


@contextmanager
def config_values() -> Iterator[None]:
    """A ValueError in the block (a value that is not a number, an AudioSpec check) as config.json's one line."""
    try:
        yield
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None


def hf_features(preprocessor: dict, defaults: dict[str, Any], audio: AudioSpec) -> dict[str, Any]:
    """preprocessor_config.json's feature settings over the family's defaults (those keys only), checked against the
    encoder's mel bins; dither (random noise in the features) refused."""
    f = {**defaults, **{k: v for k, v in preprocessor.items() if k in defaults}}
    if int(f["feature_size"]) != audio.num_mel_bins:
        raise DecodertError(f"feature_size {f['feature_size']} differs from the encoder's {audio.num_mel_bins} mel bins")
    if float(f["dither"]):
        raise DecodertError("dither adds random noise to the features; a checkpoint with dither 0 is supported")
    return f


def mel_settings(f: dict[str, Any], **more: Any) -> dict[str, Any]:
    """The log-mel settings (runtime/audio/features.py MelSettings) of checked feature settings ``f``: Slaney mels
    from 0 to 8 kHz, then the family's padding (``more``)."""
    return dict(sampling_rate=int(f["sampling_rate"]), n_fft=int(f["n_fft"]), hop_length=int(f["hop_length"]),
                n_mels=int(f["feature_size"]), f_min=0.0, f_max=8000.0, **more)
