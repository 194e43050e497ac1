"""The frozen description of an audio encoder + projector (``audio.onnx``), beside the text ``ModelSpec``.

An audio-language family (models/families/qwen3_asr.py) declares ``audio_from_hf(config) -> AudioSpec``,
``AUDIO_WEIGHTS`` (canonical audio name -> checkpoint key) and ``audio_features(preprocessor_config)`` (the
log-mel settings, runtime/audio/features.py). The text model's ``ModelSpec.images`` names the audio token: its
rows are replaced by the audio embeddings in prefill exactly as image rows are (the prefill graph's
``image_embeds`` / ``image_positions`` carry any encoder's rows; export/lowering/graph.py).

The ``qwen3_asr`` encoder (Qwen3-ASR's AuT: Whisper-like, over chunks of 2 n_window mel frames) names:

- ``audio.conv{1,2,3}[_bias]``   [D_c, 1|D_c, 3, 3] / [D_c]   Conv2d stride 2, padding 1, each then GELU (erf)
- ``audio.conv_out``             [C_a, D_c * F']             the flattened (channel, mel) axis -> C_a, no bias
- ``audio.layers.{i}.ln1[_bias]``, ``.qkv[_bias]`` [3 C_a, C_a] (q|k|v fused at load), ``.o[_bias]``,
  ``.ln2[_bias]``, ``.fc1[_bias]`` [I_a, C_a], ``.fc2[_bias]`` [C_a, I_a]
- ``audio.ln_post[_bias]`` [C_a];  ``audio.proj1[_bias]`` [C_a, C_a];  ``audio.proj2[_bias]`` [hidden, C_a]

Another encoder kind has its own frozen spec, named by its ``encoder`` field and found in ``SPECS`` (``audio_spec``
reads a manifest's dict by it; a dict without the field is a ``qwen3_asr`` one): ``gemma4``, Gemma 4's conformer
(models/audio_conformer.py ConformerSpec). ``audio_names`` / ``audio_shape`` / ``audio_dtype`` dispatch on it
likewise. Whisper itself is an encoder-decoder family with its own spec (models/families/whisper.py ``WhisperSpec``,
``ENCODER_DECODER``), not an encoder feeding a decoder-only text model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from decodert.models.audio_conformer import ConformerSpec, conformer_names, conformer_shape

ENCODERS = ("qwen3_asr",)


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
    encoder: str = "qwen3_asr"

    def __post_init__(self) -> None:
        if self.encoder not in ENCODERS:
            raise ValueError(f"audio encoder '{self.encoder}' is not one of {', '.join(ENCODERS)}")
        if self.hidden_size % self.num_heads or self.hidden_size % 2:
            raise ValueError(f"audio d_model {self.hidden_size} must be even and divisible by its {self.num_heads} heads")
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

    def tokens(self, frames: int) -> int:
        """Audio tokens of a clip of ``frames`` valid mel frames (Qwen3ASRProcessor's count)."""
        full, rest = divmod(frames, self.chunk_frames)
        return full * self.chunk_tokens + post_conv(rest)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AudioSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


SPECS: dict[str, type] = {"qwen3_asr": AudioSpec, "gemma4": ConformerSpec}  # encoder kind -> its spec


def audio_spec(d: dict[str, Any]) -> Any:
    """A manifest's audio spec dict -> the spec of its encoder kind."""
    kind = d.get("encoder", "qwen3_asr")
    if kind not in SPECS:
        raise ValueError(f"audio encoder '{kind}' is not one of {', '.join(SPECS)}")
    return SPECS[kind].from_dict(d)


def audio_names(a: Any) -> list[str]:
    """Canonical audio weight names of the encoder ``a``, in weights.bin order."""
    return _TABLES[a.encoder][0](a)


def audio_shape(a: Any, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical audio weight of the encoder ``a``."""
    return _TABLES[a.encoder][1](a, name)


def audio_dtype(a: Any, name: str, dtype: str) -> str:
    """The dtype weights.bin stores audio weight ``name`` in: the graph's, but a clipped linear's bounds, kept
    float32 (an infinite bound read as the float32 extreme would overflow fp16 as it is written; the graph casts)."""
    return "fp32" if a.encoder == "gemma4" and name.endswith("_clip") else dtype


def _asr_names(a: AudioSpec) -> list[str]:
    names = [f"audio.conv{j}{b}" for j in (1, 2, 3) for b in ("", "_bias")] + ["audio.conv_out"]
    for i in range(a.num_layers):
        p = f"audio.layers.{i}."
        names += [p + n for n in ("ln1", "ln1_bias", "qkv", "qkv_bias", "o", "o_bias", "ln2", "ln2_bias",
                                  "fc1", "fc1_bias", "fc2", "fc2_bias")]
    return names + ["audio.ln_post", "audio.ln_post_bias", "audio.proj1", "audio.proj1_bias", "audio.proj2",
                    "audio.proj2_bias"]


def _asr_shape(a: AudioSpec, name: str) -> tuple[int, ...]:
    c, inter, d = a.hidden_size, a.intermediate_size, a.conv_channels
    leaf = name.rsplit(".", 1)[-1]
    shapes = {"conv1": (d, 1, 3, 3), "conv2": (d, d, 3, 3), "conv3": (d, d, 3, 3), "conv1_bias": (d,),
              "conv2_bias": (d,), "conv3_bias": (d,), "conv_out": (c, d * a.mel_out), "qkv": (3 * c, c),
              "qkv_bias": (3 * c,), "o": (c, c), "fc1": (inter, c), "fc1_bias": (inter,), "fc2": (c, inter),
              "proj1": (c, c), "proj1_bias": (c,), "proj2": (a.out_hidden, c), "proj2_bias": (a.out_hidden,)}
    return shapes.get(leaf, (c,))


_TABLES: dict[str, tuple[Callable[..., list[str]], Callable[..., tuple[int, ...]]]] = {
    "qwen3_asr": (_asr_names, _asr_shape), "gemma4": (conformer_names, conformer_shape)}
