"""The ``gemma4`` audio encoder kind: Gemma 4's conformer (transformers' Gemma4AudioModel, after the Universal Speech
Model) and the multimodal embedder into the text model, described by a frozen ``ConformerSpec`` (models/audio.py
``KINDS["gemma4"]`` names it, with the names, shapes and dtypes below).

Canonical weight names (H = hidden_size, O = output_dims, c0/c1 the subsampling channels, M' = mels / 4):

- ``audio.sub.conv{0,1}`` [c0, 1, 3, 3] / [c1, c0, 3, 3]   Conv2d stride 2, padding 1, no bias; ``audio.sub.norm{0,1}``
  [c] (LayerNorm over the channels, no bias, then ReLU); ``audio.sub.proj`` [H, M' c1] (no bias)
- per layer ``audio.layers.{i}.``: ``ff{1,2}.pre_norm`` / ``.post_norm`` [H], ``ff{1,2}.fc1`` [4H, H], ``.fc2``
  [H, 4H]; ``attn.pre_norm``, ``attn.q`` / ``.k`` / ``.v`` / ``.o`` [H, H], ``attn.rel_k`` [H, H] (the relative
  position keys), ``attn.per_dim_scale`` [D], ``attn.post_norm``; ``conv.pre_norm``, ``conv.start`` [2H, H],
  ``conv.depthwise`` [H, 1, K], ``conv.norm``, ``conv.end`` [H, H]; ``out_norm``
- every clipped linear ``X`` also ``X_clip`` [4]: its input min, input max, output min, output max (infinite bounds
  read as the float32 extremes); none when ``clipped_linears`` is off
- ``audio.out_proj`` [O, H] + ``audio.out_proj_bias`` [O]; ``audio.embed_proj`` [hidden, O] (the embedder: a
  weightless RMSNorm, then this projection, no bias)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CLIPPED = ("ff1.fc1", "ff1.fc2", "attn.q", "attn.k", "attn.v", "attn.o", "conv.start", "conv.end", "ff2.fc1",
           "ff2.fc2")


def halve(frames: int) -> int:
    """Rows after one (kernel 3, stride 2, padding 1) convolution."""
    return (frames - 1) // 2 + 1 if frames > 0 else 0


@dataclass(frozen=True)
class ConformerSpec:
    """Gemma 4's audio tower: two stride-2 convolutions, conformer layers over chunked local attention, the output
    projection and the embedder into the text model's hidden size."""

    num_mel_bins: int  # the projection reads c0 // 4 bins after the subsampling: 4 (c0 // 4) (the extractor's)
    hidden_size: int  # H
    num_layers: int
    num_heads: int
    conv_channels: tuple[int, int]  # c0, c1
    out_hidden: int  # the text model's hidden size
    output_dims: int  # O (output_proj_dims)
    conv_kernel: int = 5  # the light conv's depthwise kernel (causal)
    chunk: int = 12  # C: query rows a block (attention_chunk_size)
    context_left: int = 13  # attention_context_left: C - 1 + this - 1 + context_right keys a block
    context_right: int = 0
    logit_cap: float = 50.0
    invalid_logit: float = -1e9
    residual_weight: float = 0.5
    gradient_clipping: float = 1e10
    clipped_linears: bool = True
    rms_norm_eps: float = 1e-6  # the light conv's norms, the subsampling LayerNorms and the embedder's norm
    begin_token_id: int | None = None  # <|audio> before a clip's tokens (Gemma4Processor)
    end_token_id: int | None = None  # <audio|> after them
    encoder: str = "gemma4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "conv_channels", tuple(int(c) for c in self.conv_channels))
        if self.encoder != "gemma4":
            raise ValueError(f"a ConformerSpec's encoder is 'gemma4', not '{self.encoder}'")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"audio hidden_size {self.hidden_size} is not divisible by its {self.num_heads} heads")
        if len(self.conv_channels) != 2:
            raise ValueError(f"subsampling_conv_channels must name 2 channel counts, not {len(self.conv_channels)}")
        if self.mel_out != self.conv_channels[0] // 4:
            raise ValueError(f"{self.num_mel_bins} mel bins make {self.mel_out} after the subsampling, but its "
                             f"projection reads subsampling_conv_channels[0] // 4 = {self.conv_channels[0] // 4}")
        if self.chunk <= 0 or self.context_left < 1 or self.context_right < 0:
            raise ValueError("attention_chunk_size must be positive, attention_context_left at least 1 and "
                             "attention_context_right not negative")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def past(self) -> int:
        """Keys before a block's first query (max_past_horizon)."""
        return self.context_left - 1

    @property
    def context(self) -> int:
        """Keys a block of ``chunk`` queries reads: chunk + past + context_right."""
        return self.chunk + self.past + self.context_right

    @property
    def positions(self) -> int:
        """Rows of the relative position table: context // 2 + 1 (distances context // 2 .. 0)."""
        return self.context // 2 + 1

    @property
    def mel_out(self) -> int:
        return halve(halve(self.num_mel_bins))

    @property
    def frame_multiple(self) -> int:
        """The runtime pads a clip's frames to a multiple of this: whole blocks after the two halvings."""
        return 4 * self.chunk

    def tokens(self, frames: int) -> int:
        """Audio tokens of a clip of ``frames`` valid mel frames (Gemma4Processor's count: its mask halved twice)."""
        return halve(halve(frames))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["conv_channels"] = list(self.conv_channels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConformerSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def clipped(a: ConformerSpec) -> tuple[str, ...]:
    return CLIPPED if a.clipped_linears else ()


def conformer_names(a: ConformerSpec) -> list[str]:
    """Canonical audio weight names, in weights.bin order."""
    names = ["audio.sub.conv0", "audio.sub.norm0", "audio.sub.conv1", "audio.sub.norm1", "audio.sub.proj"]
    per = ["ff1.pre_norm", "ff1.fc1", "ff1.fc2", "ff1.post_norm", "attn.pre_norm", "attn.q", "attn.k", "attn.v",
           "attn.o", "attn.rel_k", "attn.per_dim_scale", "attn.post_norm", "conv.pre_norm", "conv.start",
           "conv.depthwise", "conv.norm", "conv.end", "ff2.pre_norm", "ff2.fc1", "ff2.fc2", "ff2.post_norm",
           "out_norm"]
    clips = clipped(a)
    for i in range(a.num_layers):
        p = f"audio.layers.{i}."
        for n in per:
            names.append(p + n)
            if n in clips:
                names.append(p + n + "_clip")
    return names + ["audio.out_proj", "audio.out_proj_bias", "audio.embed_proj"]


def conformer_dtype(a: ConformerSpec, name: str, dtype: str) -> str:
    """The dtype weights.bin stores weight ``name`` in: the graph's, but a clipped linear's bounds, kept float32 (an
    infinite bound read as the float32 extreme would overflow fp16 as it is written; the graph casts)."""
    return "fp32" if name.endswith("_clip") else dtype


def conformer_shape(a: ConformerSpec, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical audio weight."""
    h, (c0, c1) = a.hidden_size, a.conv_channels
    if name.endswith("_clip"):
        return (4,)
    leaf = name.split(".", 3)[-1] if name.startswith("audio.layers.") else name[len("audio."):]
    shapes = {"sub.conv0": (c0, 1, 3, 3), "sub.norm0": (c0,), "sub.conv1": (c1, c0, 3, 3), "sub.norm1": (c1,),
              "sub.proj": (h, a.mel_out * c1), "ff1.fc1": (4 * h, h), "ff1.fc2": (h, 4 * h), "ff2.fc1": (4 * h, h),
              "ff2.fc2": (h, 4 * h), "attn.per_dim_scale": (a.head_dim,), "conv.start": (2 * h, h),
              "conv.depthwise": (h, 1, a.conv_kernel), "out_proj": (a.output_dims, h),
              "out_proj_bias": (a.output_dims,), "embed_proj": (a.out_hidden, a.output_dims)}
    if leaf in shapes:
        return shapes[leaf]
    return (h,) if leaf.endswith("norm") else (h, h)
