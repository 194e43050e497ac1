"""The frozen model description every other part of decodert reads: a core spec plus one spec per layer.

    ModelSpec   vocabulary, sizes, norms, RoPE, tying, bos/eos, the block's scales   (this file)
      layers    one LayerSpec per layer: a mixer spec and an MLP spec of their kind  (models/layers/)
      per_layer_inputs, images                                                       per-model extras (below)

A family file (``models/families/<family>.py``) turns a Hugging Face ``config.json`` dict or GGUF metadata into a
ModelSpec, declaring its layers with the kind specs, and declares where each *canonical* weight comes from. Graph
code only ever sees canonical names (``canonical_names`` in models/canonical.py), never checkpoint keys. Norm weights
are canonical as the factor that multiplies: a checkpoint that stores ``w`` for a ``(1 + w)`` norm (Gemma) is
shifted when it is read, as llama.cpp's converter does for GGUF.

The manifest stores ``to_dict()``; ``from_dict`` also reads the flat dict of format 1 (one key per setting, written
before the layers were declared by kind: models/spec_v1.py converts it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from decodert.models.layers import (ACTIVATIONS, MIXERS, MLPS, NO_MIXER, AttentionSpec, DenseMLPSpec,  # noqa: F401
                                    LayerSpec, MoESpec, layers_from_dict, layers_to_dict)
from decodert.models.rope import RopeSpec  # defined in models/rope.py; imported from here too
from decodert.models.spec_v1 import SPEC_FORMAT, from_flat

MAX_LAYERS = 4096  # a config's layer count is untrusted: more than this is refused before any per-layer list


@dataclass(frozen=True)
class MRopeSpec:
    """M-RoPE (Qwen2-VL / 2.5-VL / 3-VL): each rotary pair j turns by the position on axis t, h or w
    (plugins/ops/mrope.py); the graphs take rope_offsets [3, B, S] (position - cache index per axis)."""

    section: tuple[int, ...]  # pairs per axis (t, h, w), summing to rotary_dim / 2
    interleaved: bool = False  # Qwen3-VL: pairs t, h, w, t, h, w, ... instead of three blocks


@dataclass(frozen=True)
class PerLayerInputs:
    """Gemma 4 (E2B/E4B): each layer adds act(x @ ple_gate^T) * per_layer_input[i] @ ple_proj^T
    (export/lowering/per_layer.py)."""

    size: int  # P
    vocab: int  # rows of the per-layer embedding table embed_per_layer [Vp, L*P]
    activation: str = "gelu_tanh"  # of the gate

    def __post_init__(self) -> None:
        if self.size < 1 or self.vocab < 1 or self.activation not in ACTIVATIONS:
            raise ValueError(f"per-layer inputs need a positive size and vocabulary and an activation of "
                             f"{', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class ImageTokens:
    """A vision-language model's text side: prefill takes image embeddings at this token's rows."""

    token_id: int
    deepstack_layers: int = 0  # Qwen3-VL: after each of the first n layers the image rows gain deepstack_embeds[i]
    bidirectional: bool = False  # Gemma 3: in prefill, the tokens of one image attend to each other both ways
    # (transformers' token_type_ids mask); prefill then takes image_ahead (export/lowering/graph.py)
    per_layer_token: int | None = None  # Gemma 4 (audio): the per-layer inputs of the rows placed read this token's
    # (transformers: the pad token's), not the placeholder's (export/lowering/per_layer.py)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the graph recipe needs about a decoder-only model."""

    family: str  # models/families/<family>.py
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    layers: tuple[LayerSpec, ...]
    rope: RopeSpec = field(default_factory=RopeSpec)
    local_rope: RopeSpec | None = None  # the table of attention layers with rope_table "rope_local" (Gemma 3)
    mrope: MRopeSpec | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # -- the block around the layers; the defaults are Llama's ----------------------------------------
    embed_scale: float | None = None  # Gemma: embeddings x sqrt(hidden), the factor rounded to the graph dtype
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    logits_scaling: float = 1.0  # Granite: logits / this
    residual_scale: float = 1.0  # Granite: each mixer and MLP output x this before its residual add
    sandwich_norm: bool = False  # Gemma 2/3: RMSNorm on the mixer and MLP outputs before each residual add
    layer_scalar: bool = False  # Gemma 4: the residual stream x layers.{i}.layer_scalar [1] after each layer
    per_layer_inputs: PerLayerInputs | None = None
    images: ImageTokens | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple) or not all(isinstance(layer, LayerSpec) for layer in self.layers):
            raise ValueError("layers must be a tuple of LayerSpec")
        if self.local_rope is not None and self.local_rope.rotary_dim != self.rope.rotary_dim:
            raise ValueError("the local and global RoPE must rotate the same dims")
        tables: dict[str, set[int]] = {}
        for i, a in self._attention():
            if a.rope_table == "rope_local" and self.local_rope is None:
                raise ValueError(f"layer {i} reads the local RoPE table: the model needs a local_rope")
            tables.setdefault(a.rope_table, set()).add(a.head_dim)
        if any(len(d) > 1 for d in tables.values()):
            raise ValueError("layers of one RoPE table must share a head_dim (give the sliding layers a local_rope)")
        self._check_kv_sources()
        if self.mrope is not None and (len(self.mrope.section) != 3 or min(self.mrope.section) < 0
                                       or sum(self.mrope.section) != (self.rope.rotary_dim or self.head_dim) // 2):
            raise ValueError(f"mrope_section {list(self.mrope.section)} must be 3 counts summing to half the rotary dim")
        for name in ("final_softcap", "embed_scale", "residual_scale", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} {value!r} must be positive")

    def _attention(self) -> list[tuple[int, AttentionSpec]]:
        return [(i, layer.mixer) for i, layer in enumerate(self.layers) if isinstance(layer.mixer, AttentionSpec)]

    def _check_kv_sources(self) -> None:
        sharing = [(i, a.kv_source) for i, a in self._attention() if a.kv_source is not None]
        if not sharing:
            return
        kv = self.kv_layers
        for i, j in sharing:
            source = self.layers[j].mixer if 0 <= j < i else None
            if (not isinstance(source, AttentionSpec) or source.kv_source is not None
                    or source.window != self.attention_of(i).window or self.layer_kinds
                    or list(kv) != list(range(len(kv)))):
                raise ValueError(f"kv_sources must name, for each of {self.num_layers} layers, itself or an earlier "
                                 "attention layer of the same kind that keeps its own cache; the layers that share "
                                 "come last (the manifest's K/V layers are 0..n-1), in a model of attention layers only")

    # ---- per layer ------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def mixer(self, layer: int) -> Any:
        """Layer ``layer``'s mixer spec (None: the layer is its MLP alone)."""
        return self.layers[layer].mixer

    def mlp(self, layer: int) -> Any:
        """Layer ``layer``'s MLP spec (None: the layer is its mixer alone)."""
        return self.layers[layer].mlp

    def layer_kind(self, layer: int) -> str:
        """What mixes tokens in layer ``layer``: one of LAYER_KINDS."""
        return self.layers[layer].mixer_kind

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Every layer's kind; () where every layer is attention (the manifest's kv.layer_kinds)."""
        kinds = tuple(layer.mixer_kind for layer in self.layers)
        return () if set(kinds) == {"attention"} else kinds

    def attention_of(self, layer: int) -> AttentionSpec:
        """Layer ``layer``'s attention spec; ValueError for a layer of another kind."""
        mixer = self.layers[layer].mixer
        if not isinstance(mixer, AttentionSpec):
            raise ValueError(f"layer {layer} is a '{self.layer_kind(layer)}' layer, not attention")
        return mixer

    @property
    def attention(self) -> AttentionSpec | None:
        """The first attention layer's spec: the model's heads and head_dim (None without attention layers)."""
        found = self._attention()
        return found[0][1] if found else None

    @property
    def num_heads(self) -> int:
        return self._attn().num_heads

    @property
    def num_kv_heads(self) -> int:
        return self._attn().num_kv_heads

    @property
    def head_dim(self) -> int:
        """The first attention layer's head_dim (Gemma 4's sliding layers'; ``head_dim_of`` gives each layer's)."""
        return self._attn().head_dim

    def _attn(self) -> AttentionSpec:
        a = self.attention
        if a is None:
            raise ValueError(f"{self.family} has no attention layer")
        return a

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V (attention), in order: their caches are past_key.{i} / past_value.{i}."""
        return tuple(i for i, a in self._attention() if a.kv_source is None)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V cache layer ``layer`` attends over: itself, or (Gemma 4's KV sharing) an earlier
        layer of the same kind; a sharing layer computes no K/V and has no cache of its own."""
        mixer = self.layers[layer].mixer
        return mixer.kv_source if isinstance(mixer, AttentionSpec) and mixer.kv_source is not None else layer

    def head_dim_of(self, layer: int) -> int:
        """Layer ``layer``'s head_dim (its q, k, v heads and its cache's last dimension); the model's for a layer
        without attention."""
        mixer = self.layers[layer].mixer
        return mixer.head_dim if isinstance(mixer, AttentionSpec) else self.head_dim

    @property
    def head_dims(self) -> tuple[int, ...]:
        """The head_dim of each K/V layer (``kv_layers``), in order: their caches' last dimension."""
        return tuple(self.head_dim_of(i) for i in self.kv_layers)

    @property
    def uniform_head_dim(self) -> bool:
        """Whether every attention layer has the model's head_dim (the manifest's kv.head_dims is () then)."""
        return all(a.head_dim == self.head_dim for _, a in self._attention())

    def has_mlp(self, layer: int) -> bool:
        """Does layer ``layer`` end with an MLP (post_norm + MLP)?"""
        return self.layers[layer].mlp is not None

    def has_mixer(self, layer: int) -> bool:
        """Does layer ``layer`` mix tokens (input_norm + mixer)? Not a layer that is its MLP alone."""
        return self.layers[layer].mixer is not None

    def is_moe(self, layer: int) -> bool:
        """Is layer ``layer``'s MLP a mixture of experts (router + experts) rather than one dense MLP?"""
        return isinstance(self.layers[layer].mlp, MoESpec)

    def dense_mlp(self, layer: int) -> DenseMLPSpec | None:
        """Layer ``layer``'s dense MLP: its MLP, or the shared MLP beside its experts (None: neither)."""
        mlp = self.layers[layer].mlp
        return mlp.shared if isinstance(mlp, MoESpec) else mlp

    def mlp_size(self, layer: int) -> int:
        """The dense MLP width of layer ``layer`` (Gemma 4: double on the KV-sharing layers)."""
        dense = self.dense_mlp(layer)
        if dense is None:
            raise ValueError(f"layer {layer} has no dense MLP")
        return dense.size

    def experts(self) -> MoESpec | None:
        """The first MoE layer's spec (None: no MoE layer); what the memory and bandwidth estimates read."""
        return next((layer.mlp for layer in self.layers if isinstance(layer.mlp, MoESpec)), None)

    def is_sliding(self, layer: int) -> bool:
        """Does layer ``layer`` attend over a sliding window (the rest see the whole prefix)?"""
        mixer = self.layers[layer].mixer
        return isinstance(mixer, AttentionSpec) and mixer.window is not None

    def layer_window(self, layer: int) -> int | None:
        mixer = self.layers[layer].mixer
        return mixer.window if isinstance(mixer, AttentionSpec) else None

    def layer_rope(self, layer: int) -> RopeSpec:
        return rope_tables(self, every=True)[rope_table_of(self, layer)]

    # ---- the manifest's model section ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON values: the core settings, the distinct mixer and MLP specs, and per layer their indices.
        ``num_layers``, ``num_heads``, ``num_kv_heads`` and ``head_dim`` are written for readers of the manifest
        (the typed model record, ``decodert inspect``) and ignored by ``from_dict``."""
        a = self.attention
        out: dict[str, Any] = {
            "spec_format": SPEC_FORMAT, "family": self.family, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_layers": self.num_layers,
            "num_heads": a.num_heads if a else None, "num_kv_heads": a.num_kv_heads if a else None,
            "head_dim": a.head_dim if a else None, "rms_norm_eps": self.rms_norm_eps,
            "rope": dataclasses.asdict(self.rope),
            "local_rope": None if self.local_rope is None else dataclasses.asdict(self.local_rope),
            "mrope": None if self.mrope is None else {"section": list(self.mrope.section),
                                                      "interleaved": self.mrope.interleaved},
            "max_position": self.max_position, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
            "embed_scale": self.embed_scale, "final_softcap": self.final_softcap,
            "logits_scaling": self.logits_scaling, "residual_scale": self.residual_scale,
            "sandwich_norm": self.sandwich_norm, "layer_scalar": self.layer_scalar,
            "per_layer_inputs": None if self.per_layer_inputs is None else dataclasses.asdict(self.per_layer_inputs),
            "images": None if self.images is None else dataclasses.asdict(self.images),
            **layers_to_dict(self.layers),
        }
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        """The inverse of to_dict; a format-1 dict (flat, no ``layers``) is converted first (models/spec_v1.py)."""
        if "layers" not in d:
            d = from_flat(d)
        mrope = d.get("mrope")
        return cls(
            family=d["family"], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            rms_norm_eps=d["rms_norm_eps"], layers=layers_from_dict(d), rope=RopeSpec(**d["rope"]),
            local_rope=None if d.get("local_rope") is None else RopeSpec(**d["local_rope"]),
            mrope=None if mrope is None else MRopeSpec(tuple(mrope["section"]), mrope.get("interleaved", False)),
            max_position=d.get("max_position", 4096), tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=tuple(d.get("eos_token_ids", ())),
            embed_scale=d.get("embed_scale"), final_softcap=d.get("final_softcap"),
            logits_scaling=d.get("logits_scaling", 1.0), residual_scale=d.get("residual_scale", 1.0),
            sandwich_norm=d.get("sandwich_norm", False), layer_scalar=d.get("layer_scalar", False),
            per_layer_inputs=None if d.get("per_layer_inputs") is None else PerLayerInputs(**d["per_layer_inputs"]),
            images=None if d.get("images") is None else ImageTokens(**d["images"]),
        )


NO_ROPE = RopeSpec(scaling="none")  # what a layer without RoPE reads: the identity rotation
# What mixes tokens in a layer: a kind of models/layers/ (MIXERS), or "none": no mixer, the layer is its MLP
# alone (Nemotron-H's MLP blocks; an MLP of None is the converse, a mixer without an MLP).
LAYER_KINDS = (*MIXERS, NO_MIXER)
MLP_TYPES = (*MLPS, "none")


@dataclass(frozen=True)
class StateSpec:
    """One per-slot state tensor a non-attention layer keeps (graph I/O ``past_{name}.{layer}`` /
    ``present_{name}.{layer}``, one buffer [batch, *shape] bound to both)."""

    layer: int
    name: str  # "conv" | "recurrent"
    shape: tuple[int, ...]  # per slot, without the batch dim
    dtype: str | None = None  # None: the model dtype; "fp32": a recurrent state, whatever the model dtype

    @property
    def io_name(self) -> str:
        return f"{self.name}.{self.layer}"


def window_layers(spec: ModelSpec) -> tuple[int, ...]:
    """Conv layers whose verify pass outputs its conv window ``window_conv.{i}`` [B, C, K-1+S] (the pass's
    inputs after the state), so accepting j tokens takes the state after j from it instead of a replay;
    () unless every state of the model is a conv state (a recurrent state cannot be taken from its inputs)."""
    states = state_specs(spec)
    if not states or any(st.name != "conv" for st in states):
        return ()
    return tuple(st.layer for st in states)


def state_specs(spec: ModelSpec) -> tuple[StateSpec, ...]:
    """Every per-slot state of the model beyond K/V, by layer, then name (the graphs' I/O order)."""
    return tuple(StateSpec(i, name, shape, STATE_DTYPES.get(name)) for i, layer in enumerate(spec.layers)
                 if layer.mixer is not None for name, shape in layer.mixer.states(spec.hidden_size).items())


# A recurrent state accumulates every step: it is kept in float32 in fp16/bf16 models too (ONNX Runtime's
# GatedDeltaNet takes no other type); a conv state holds inputs as they were, in the model dtype.
STATE_DTYPES = {"recurrent": "fp32"}


def rope_head_dim(spec: ModelSpec, table: str) -> int:
    """The head_dim of the layers that read RoPE table ``table`` (one per table: ModelSpec checks it)."""
    return next((a.head_dim for _, a in spec._attention() if a.rope_table == table), spec.head_dim)


def rope_tables(spec: ModelSpec, every: bool = False) -> dict[str, RopeSpec]:
    """The RoPE tables a model's graphs read, by weight-name prefix: ``rope`` (+ ``rope_local``, ``rope_none``
    where a layer reads them; ``every``: all three, whether read or not)."""
    read = {a.rope_table for _, a in spec._attention()}
    tables = {"rope": spec.rope}
    if spec.local_rope is not None and (every or "rope_local" in read):
        tables["rope_local"] = spec.local_rope
    if every or "rope_none" in read:
        tables["rope_none"] = dataclasses.replace(NO_ROPE, rotary_dim=spec.rope.rotary_dim)
    return tables


def rope_table_of(spec: ModelSpec, layer: int) -> str:
    """The rope_tables prefix layer ``layer`` reads ("rope" for a layer without attention)."""
    mixer = spec.layers[layer].mixer
    return mixer.rope_table if isinstance(mixer, AttentionSpec) else "rope"
