"""The "mamba2" mixer (Nemotron-H, Granite 4.0-H; Di = H Dh, C = Di + 2 G N).

    z, xBC, dt = split(h @ mamba_in^T)               xBC through a causal conv (K taps, + conv_bias, silu)
    y = SSM(x, dt, B, C; a_log, dt_bias, D) over the recurrent state [H, N, Dh] (float32)
    o = (grouped rmsnorm(y * silu(z)) * w) @ mamba_out^T
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Mamba2Spec:
    kind: ClassVar[str] = "mamba2"
    heads: int
    head_dim: int
    state: int  # N
    groups: int  # of B/C (and of the gated norm)
    kernel: int  # the conv's taps over x, B, C
    conv_bias: bool = False

    def __post_init__(self) -> None:
        if self.kernel < 2:
            raise ValueError("mamba2 layers need a conv kernel of >= 2 taps")
        if min(self.heads, self.head_dim, self.state, self.groups) < 1 or self.heads % self.groups:
            raise ValueError(f"mamba2 layers need positive ssm sizes and heads ({self.heads}) a multiple of "
                             f"groups ({self.groups})")

    @property
    def inner(self) -> int:
        """The inner width H Dh (x, z, y)."""
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the conv: x, B and C (H Dh + 2 G N)."""
        return self.inner + 2 * self.groups * self.state

    def leaves(self) -> list[str]:
        return ["mamba_in", "mamba_conv", *(["mamba_conv_bias"] if self.conv_bias else []), "mamba_a_log",
                "mamba_dt_bias", "mamba_d", "mamba_norm", "mamba_out"]

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        h, c = self.heads, self.conv_channels
        return {"mamba_in": (self.inner + c + h, hidden), "mamba_conv": (c, 1, self.kernel), "mamba_conv_bias": (c,),
                "mamba_a_log": (h,), "mamba_dt_bias": (h,), "mamba_d": (h,), "mamba_norm": (self.inner,),
                "mamba_out": (hidden, self.inner)}

    def fused_rows(self, leaf: str) -> tuple[int, ...] | None:
        return None

    def states(self, hidden: int) -> dict[str, tuple[int, ...]]:
        # [H, N, Dh]: ONNX Runtime's LinearAttention state (B, H, d_k, d_v) with k = B, v = dt x, bound as is
        return {"conv": (self.conv_channels, self.kernel - 1),  # conv over x, B, C
                "recurrent": (self.heads, self.state, self.head_dim)}
