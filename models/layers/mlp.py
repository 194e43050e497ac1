"""The "dense" MLP: down(act(gate) * up), gate and up from one fused weight (down(act(up)) where not gated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

ACTIVATIONS = ("silu", "gelu_tanh", "relu2")  # gelu_tanh: Gemma's gelu_pytorch_tanh; relu2: relu(x)^2 (Nemotron-H)


@dataclass(frozen=True)
class DenseMLPSpec:
    kind: ClassVar[str] = "dense"
    size: int  # I, the intermediate width
    activation: str = "silu"
    gated: bool = True  # False: down(act(up)) (Nemotron-H), weights layers.{i}.up

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")

    def leaves(self) -> list[str]:
        return ["gate_up" if self.gated else "up", "down"]

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        i = self.size
        return {"gate_up": (2 * i, hidden), "up": (i, hidden), "down": (hidden, i)}
