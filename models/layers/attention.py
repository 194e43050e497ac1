"""The "attention" mixer: GQA over the layer's K/V cache, and every variant a family declares.

    qkv   = h @ qkv^T (+ qkv_bias)          [T, (H + 2 H_kv) D]   (output_gate: q | gate | k | v rows)
    q, k  = rmsnorm(q), rmsnorm(k) per head (qk_norm; v_norm: a weightless rmsnorm on v)
    y     = softmax(softcap(q k^T * scale) + mask (+ sink)) v over the cache, RoPE table ``rope_table``,
            a sliding ``window`` or the whole prefix
    o     = (y * sigmoid(gate)) @ o^T (+ o_bias)
    K/V   past_key.{i} / past_value.{i} [B, H_kv, S_max, D], or none where ``kv_source`` names the layer
          whose cache this one reads (Gemma 4): then the layer projects q only (``layers.{i}.q``)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

ROPE_TABLES = ("rope", "rope_local", "rope_none")  # the model's RoPE, the sliding layers' own, the identity (NoPE)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer (layers of the same settings share one instance)."""

    kind: ClassVar[str] = "attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False  # Qwen2, gpt-oss
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
    v_norm: bool = False  # Gemma 4: RMSNorm without weight over head_dim on v (with qk_norm)
    o_bias: bool = False  # gpt-oss: a bias on the output projection
    sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax (weights layers.{i}.sinks)
    output_gate: bool = False  # Qwen3.5: q_proj also yields a gate per head; the output *= sigmoid(gate)
    window: int | None = None  # a sliding window (Mistral, Gemma's sliding layers); None: the whole prefix
    rope_table: str = "rope"  # ROPE_TABLES: the model's rope, its local_rope (sliding layers), or none (NoPE)
    scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5)
    softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap), before the causal mask
    kv_source: int | None = None  # Gemma 4: the earlier layer whose K/V cache this one reads; None: its own

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_table not in ROPE_TABLES:
            raise ValueError(f"rope_table '{self.rope_table}' is not one of {', '.join(ROPE_TABLES)}")
        for name in ("window", "scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} {value!r} must be positive")
        if self.v_norm and not self.qk_norm:
            raise ValueError("v_norm comes with qk_norm (Gemma 4)")

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused qkv weight: (H + 2 H_kv) * D, plus H * D gate rows with output_gate."""
        return (self.num_heads * (2 if self.output_gate else 1) + 2 * self.num_kv_heads) * self.head_dim

    def leaves(self) -> list[str]:
        """The leaf names of the layer's weights (``layers.{i}.<leaf>``), in weights.bin order."""
        names = ["qkv", *(["qkv_bias"] if self.qkv_bias else []), *(["q_norm", "k_norm"] if self.qk_norm else []), "o",
                 *(["o_bias"] if self.o_bias else []), *(["sinks"] if self.sinks else [])]
        if self.kv_source is not None:  # a layer reading another's K/V projects q only
            names = ["q" if leaf == "qkv" else leaf for leaf in names if leaf != "k_norm"]
        return names

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        h, d = self.num_heads, self.head_dim
        return {"qkv": (self.qkv_rows, hidden), "qkv_bias": (self.qkv_rows,), "q": (h * d, hidden), "q_norm": (d,),
                "k_norm": (d,), "o": (hidden, h * d), "o_bias": (hidden,), "sinks": (h,)}

    def fused_rows(self, leaf: str) -> tuple[int, ...] | None:
        """The row count of each checkpoint part concatenated into a fused weight (None: not fused here)."""
        if leaf not in ("qkv", "qkv_bias"):
            return None
        q = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        return (q, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)

    def states(self, hidden: int) -> dict[str, tuple[int, ...]]:
        return {}  # K/V are the KV cache (ModelSpec.kv_layers), not per-slot states
