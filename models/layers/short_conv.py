"""The "conv" mixer: LFM2's gated short convolution over a rolling conv state (C = hidden).

    b, c, x = split(h @ conv_in^T (+ conv_in_bias))     [.., C] each
    y       = c * causal_conv(b * x)                    depthwise, K taps (+ conv_bias), state: the last K-1 inputs
    o       = y @ conv_out^T (+ conv_out_bias)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ShortConvSpec:
    kind: ClassVar[str] = "conv"
    kernel: int  # K taps (LFM2 conv_L_cache); the state keeps K-1 inputs
    bias: bool = False  # biases on the in/out projections and the conv

    def __post_init__(self) -> None:
        if self.kernel < 2:
            raise ValueError("conv layers need a kernel of >= 2 taps")

    def leaves(self) -> list[str]:
        if self.bias:
            return ["conv_in", "conv_in_bias", "conv", "conv_bias", "conv_out", "conv_out_bias"]
        return ["conv_in", "conv", "conv_out"]

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        h = hidden
        return {"conv_in": (3 * h, h), "conv_in_bias": (3 * h,), "conv": (h, 1, self.kernel), "conv_bias": (h,),
                "conv_out": (h, h), "conv_out_bias": (h,)}

    def fused_rows(self, leaf: str) -> tuple[int, ...] | None:
        return None

    def states(self, hidden: int) -> dict[str, tuple[int, ...]]:
        return {"conv": (hidden, self.kernel - 1)}  # [C, K-1]: the last K-1 inputs of the conv
