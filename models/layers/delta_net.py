"""The "linear_attention" mixer: Qwen3.5's Gated DeltaNet (Kd = Hk Dk, Vd = Hv Dv, C = 2 Kd + Vd).

    q, k, v, z, b, a = split(h @ linear_in^T)          q, k, v through a causal conv (K taps, silu) over its state
    y = gated delta rule(l2norm q, l2norm k, v; a_log, dt_bias) over the recurrent state [Hv, Dv, Dk] (float32)
    o = (rmsnorm(y per value head) * w * silu(z)) @ linear_out^T
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    kind: ClassVar[str] = "linear_attention"
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int  # the conv's taps over q, k, v

    def __post_init__(self) -> None:
        if self.kernel < 2:
            raise ValueError("linear_attention layers need a conv kernel of >= 2 taps")
        if min(self.key_heads, self.value_heads, self.key_dim, self.value_dim) < 1:
            raise ValueError("linear_attention layers need positive head counts and dims")

    @property
    def conv_channels(self) -> int:
        """Channels of the conv: q, k and v (2 Hk Dk + Hv Dv)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def leaves(self) -> list[str]:
        return ["linear_in", "linear_conv", "linear_a_log", "linear_dt_bias", "linear_norm", "linear_out"]

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        hv = self.value_heads
        return {"linear_in": (sum(self.fused_rows("linear_in") or ()), hidden),
                "linear_conv": (self.conv_channels, 1, self.kernel), "linear_a_log": (hv,), "linear_dt_bias": (hv,),
                "linear_norm": (self.value_dim,), "linear_out": (hidden, hv * self.value_dim)}

    def fused_rows(self, leaf: str) -> tuple[int, ...] | None:
        """linear_in's parts: the conv's q, k, v rows, then z, b, a."""
        if leaf != "linear_in":
            return None
        hv = self.value_heads
        return (self.conv_channels, hv * self.value_dim, hv, hv)

    def states(self, hidden: int) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.conv_channels, self.kernel - 1),  # conv over q, k, v
                # V-major [H_v, Dv, Dk]: ONNX Runtime's GatedDeltaNet state, bound as is (plugins/ops/gated_delta_net.py)
                "recurrent": (self.value_heads, self.value_dim, self.key_dim)}
