"""The frozen model description every other part of decodert reads.

A family file (``models/llama.py`` ...) turns a Hugging Face ``config.json`` dict or GGUF
metadata into a :class:`ModelSpec` and declares where each *canonical* weight comes from.
Graph code only ever sees canonical names (see ``canonical_names`` below), never checkpoint keys.
Norm weights are canonical as the factor that multiplies: a checkpoint that stores ``w`` for a
``(1 + w)`` norm (Gemma) is shifted when it is read, as llama.cpp's converter does for GGUF.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding (rotate-half / NeoX layout, as in transformers)."""

    theta: float = 10000.0
    scaling: str | None = None  # None | "linear" | "llama3" | "yarn" | "none" (angle 0: cos 1, sin 0, an exact identity)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3
    rotary_dim: int | None = None  # None = the whole head
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it (0.1 ln(factor) + 1 by default)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """[rot_dim/2] float64 inverse frequencies after scaling."""
        dim = self.rotary_dim or head_dim
        if self.scaling == "none":  # a layer without RoPE: every angle 0, so rotating is x*1 + rot(x)*0 = x exactly
            return np.zeros(dim // 2)
        inv = 1.0 / (self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.scaling == "linear":
            inv = inv / self.factor
        elif self.scaling == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        elif self.scaling == "yarn":
            inv = self._yarn(inv, dim)
        return inv

    def _yarn(self, inv: np.ndarray, dim: int) -> np.ndarray:
        """YaRN (transformers' _compute_yarn_parameters): interpolated frequencies (inv / factor) for the
        long wavelengths, the original ones for the short, a linear ramp between the correction dims."""
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
        extrapolation = 1 - ramp
        return inv / self.factor * (1 - extrapolation) + inv * extrapolation

    def cos_sin(self, head_dim: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin tables [max_pos, rot_dim/2] in float32 (computed in float64)."""
        angles = np.outer(np.arange(max_pos, dtype=np.float64), self.inv_freq(head_dim))
        a = self.attention_factor
        return (np.cos(angles) * a).astype(np.float32), (np.sin(angles) * a).astype(np.float32)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the graph recipe needs about a decoder-only transformer."""

    family: str  # models/<family>.py
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec = field(default_factory=RopeSpec)
    max_position: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # window of the sliding layers (Mistral: every layer; None = none)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # -- what a family changes beyond Llama; the defaults are Llama's -------------------------------
    activation: str = "silu"  # MLP gate: "silu" | "gelu_tanh" (Gemma's gelu_pytorch_tanh)
    sandwich_norm: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs before each residual add
    embed_scale: float | None = None  # Gemma: embeddings x sqrt(hidden), the factor rounded to the graph dtype
    layer_types: tuple[str, ...] = ()  # per layer "sliding" | "full"; () = all sliding iff sliding_window
    local_rope: RopeSpec | None = None  # RoPE of the sliding layers when it differs (Gemma 3: local base)
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap), before the causal mask
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    # -- mixture of experts (num_experts = 0: every MLP is dense) -----------------------------------
    num_experts: int = 0  # experts per MoE layer
    experts_per_token: int = 0  # top-k the router picks
    expert_intermediate_size: int = 0  # each expert's SwiGLU width
    router_renormalize: bool = True  # the top-k softmax weights are rescaled to sum to 1 (Qwen3-MoE norm_topk_prob)
    mlp_types: tuple[str, ...] = ()  # per layer "dense" | "moe"; () = every layer "moe" iff num_experts
    o_bias: bool = False  # gpt-oss: a bias on the attention output projection
    attn_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax (weights layers.{i}.sinks)
    router_bias: bool = False  # gpt-oss: router logits = h @ router^T + bias
    expert_bias: bool = False  # gpt-oss: biases on every expert's gate_up and down
    swiglu_limit: float | None = None  # gpt-oss: gate clamped to <= limit, up to [-limit, limit]
    swiglu_alpha: float = 1.0  # experts: gate * sigmoid(alpha * gate) * (up + beta); silu(gate) * up by default
    swiglu_beta: float = 0.0
    nope_layers: tuple[int, ...] = ()  # layers whose q and k get no RoPE (SmolLM3: every 4th); they read the
    # identity table "rope_none" (angle 0), so every lowering's attention serves them unchanged
    image_token_id: int | None = None  # vision-language: prefill takes image embeddings at this token's rows

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types must name {self.num_layers} layers, each one of {', '.join(LAYER_TYPES)}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")
        if self.local_rope is not None and self.local_rope.rotary_dim != self.rope.rotary_dim:
            raise ValueError("the local and global RoPE must rotate the same dims")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts or self.expert_intermediate_size < 1:
                raise ValueError(f"router top-k {self.experts_per_token} must be 1..{self.num_experts} experts and "
                                 f"the expert width {self.expert_intermediate_size} positive")
            if self.activation != "silu":  # the MoE/QMoE ops and plugins/moe.py compute SwiGLU experts
                raise ValueError(f"experts with activation '{self.activation}' are not supported (SwiGLU only)")
        if self.mlp_types and (len(self.mlp_types) != self.num_layers or set(self.mlp_types) - set(MLP_TYPES)
                               or ("moe" in self.mlp_types and not self.num_experts)):
            raise ValueError(f"mlp_types must name {self.num_layers} layers, each one of {', '.join(MLP_TYPES)} "
                             "('moe' only with experts)")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)} must be layers 0..{self.num_layers - 1}")
        for name in ("sliding_window", "attn_softcap", "final_softcap", "attn_scale", "embed_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} {value!r} must be positive")

    def is_sliding(self, layer: int) -> bool:
        """Does layer ``layer`` attend over a sliding window (the rest see the whole prefix)?"""
        if self.layer_types:
            return self.layer_types[layer] == "sliding"
        return self.sliding_window is not None

    def is_moe(self, layer: int) -> bool:
        """Is layer ``layer``'s MLP a mixture of experts (router + experts) rather than one dense SwiGLU?"""
        if self.mlp_types:
            return self.mlp_types[layer] == "moe"
        return self.num_experts > 0

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> RopeSpec:
        if layer in self.nope_layers:
            return dataclasses.replace(NO_ROPE, rotary_dim=self.rope.rotary_dim)
        return self.local_rope if self.local_rope is not None and self.is_sliding(layer) else self.rope

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        """Rows of the fused qkv weight: (H + 2 H_kv) * D."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["mlp_types"] = list(self.mlp_types)
        d["nope_layers"] = list(self.nope_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        """The inverse of to_dict; a dict written before a field existed gets that field's default."""
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        if d.get("local_rope") is not None:
            d["local_rope"] = RopeSpec(**d["local_rope"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["mlp_types"] = tuple(d.get("mlp_types", ()))
        d["nope_layers"] = tuple(d.get("nope_layers", ()))
        return cls(**d)


NO_ROPE = RopeSpec(scaling="none")  # what a layer without RoPE reads: the identity rotation
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("sliding", "full")
MLP_TYPES = ("dense", "moe")


def rope_tables(spec: ModelSpec) -> dict[str, RopeSpec]:
    """The RoPE tables a model's graphs read, by weight-name prefix: ``rope`` (+ ``rope_local``)."""
    tables = {"rope": spec.rope}
    if spec.local_rope is not None and any(spec.is_sliding(i) for i in range(spec.num_layers)):
        tables["rope_local"] = spec.local_rope
    if spec.nope_layers:
        tables["rope_none"] = dataclasses.replace(NO_ROPE, rotary_dim=spec.rope.rotary_dim)
    return tables


def rope_table_of(spec: ModelSpec, layer: int) -> str:
    """The rope_tables prefix layer ``layer`` reads."""
    if layer in spec.nope_layers:
        return "rope_none"
    return "rope_local" if spec.local_rope is not None and spec.is_sliding(layer) else "rope"


def canonical_names(spec: ModelSpec) -> list[str]:
    """Canonical weight names, in the order they are written to weights.bin.

    Layout is the checkpoint's [out_features, in_features] for every linear weight.

    - ``embed``                     [V, hidden]
    - ``layers.{i}.input_norm``     [hidden]
    - ``layers.{i}.qkv``            [(H + 2 H_kv) * D, hidden]   rows: q heads, k heads, v heads
    - ``layers.{i}.qkv_bias``       [(H + 2 H_kv) * D]           (qkv_bias only)
    - ``layers.{i}.q_norm``         [D]                          (qk_norm only)
    - ``layers.{i}.k_norm``         [D]                          (qk_norm only)
    - ``layers.{i}.o``              [hidden, H * D]
    - ``layers.{i}.o_bias``         [hidden]                     (o_bias only)
    - ``layers.{i}.sinks``          [H]                          (attn_sinks only: each head's sink logit)
    - ``layers.{i}.attn_out_norm``  [hidden]                     (sandwich_norm only: on the attention output)
    - ``layers.{i}.post_norm``      [hidden]                     the norm in front of the MLP
    - ``layers.{i}.gate_up``        [2 * I, hidden]              rows: gate, then up
    - ``layers.{i}.down``           [hidden, I]
      or, in a MoE layer (spec.is_moe(i); Ie = expert_intermediate_size, E = num_experts):
    - ``layers.{i}.router``         [E, hidden]                  router logits = h @ router^T
    - ``layers.{i}.experts.gate_up`` [E, 2 * Ie, hidden]         rows interleaved: gate 0, up 0, gate 1, ...
    - ``layers.{i}.experts.down``   [E, hidden, Ie]
    - ``layers.{i}.router_bias`` [E], ``experts.gate_up_bias`` [E, 2 Ie] (interleaved), ``experts.down_bias``
      [E, hidden]                                                (router_bias / expert_bias only)
    - ``layers.{i}.mlp_out_norm``   [hidden]                     (sandwich_norm only: on the MLP output)
    - ``final_norm``                [hidden]
    - ``lm_head``                   [V, hidden]                  (absent when tied)
    """
    names = ["embed"]
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        names += [p + "input_norm", p + "qkv"]
        if spec.qkv_bias:
            names.append(p + "qkv_bias")
        if spec.qk_norm:
            names += [p + "q_norm", p + "k_norm"]
        names.append(p + "o")
        if spec.o_bias:
            names.append(p + "o_bias")
        if spec.attn_sinks:
            names.append(p + "sinks")
        if spec.sandwich_norm:
            names.append(p + "attn_out_norm")
        names.append(p + "post_norm")
        if not spec.is_moe(i):
            names += [p + "gate_up", p + "down"]
        else:
            names += [p + "router"] + ([p + "router_bias"] if spec.router_bias else []) + [p + "experts.gate_up"]
            names += [p + "experts.gate_up_bias"] if spec.expert_bias else []
            names += [p + "experts.down"] + ([p + "experts.down_bias"] if spec.expert_bias else [])
        if spec.sandwich_norm:
            names.append(p + "mlp_out_norm")
    names.append("final_norm")
    if not spec.tie_word_embeddings:
        names.append("lm_head")
    return names


def canonical_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical weight (used to validate checkpoints)."""
    h, d = spec.hidden_size, spec.head_dim
    leaf = name.rsplit(".", 1)[-1]
    e, ie = spec.num_experts, spec.expert_intermediate_size
    if ".experts." in name:
        return {"gate_up": (e, 2 * ie, h), "down": (e, h, ie), "gate_up_bias": (e, 2 * ie), "down_bias": (e, h)}[leaf]
    shapes = {
        "router": (e, h),
        "router_bias": (e,),
        "o_bias": (h,),
        "sinks": (spec.num_heads,),
        "embed": (spec.vocab_size, h),
        "lm_head": (spec.vocab_size, h),
        "final_norm": (h,),
        "input_norm": (h,),
        "post_norm": (h,),
        "attn_out_norm": (h,),
        "mlp_out_norm": (h,),
        "qkv": (spec.qkv_size, h),
        "qkv_bias": (spec.qkv_size,),
        "q_norm": (d,),
        "k_norm": (d,),
        "o": (h, spec.num_heads * d),
        "gate_up": (2 * spec.intermediate_size, h),
        "down": (h, spec.intermediate_size),
    }
    return shapes[leaf]
