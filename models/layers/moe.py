"""The "moe" MLP: a router picks the top-k of E SwiGLU experts per token (E = num_experts, Ie = expert_size).

    logits  = h @ router^T (+ router_bias)            [T, E]
    y       = sum over the top k of softmax weights (renormalised) * expert_j(h)
    expert  = down_j(swiglu(gate_j, up_j)) (+ biases)  gate/up rows interleaved: gate 0, up 0, gate 1, ...
    + the shared dense MLP where ``shared`` (Granite 4.0-H), x sigmoid(h @ shared_gate^T) where ``shared_gate``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from decodert.models.layers.mlp import DenseMLPSpec


@dataclass(frozen=True)
class MoESpec:
    kind: ClassVar[str] = "moe"
    num_experts: int
    experts_per_token: int  # top-k
    expert_size: int  # each expert's SwiGLU width
    renormalize: bool = True  # the top-k weights rescaled to sum to 1 (Qwen3-MoE norm_topk_prob)
    router_bias: bool = False  # gpt-oss
    expert_bias: bool = False  # gpt-oss: biases on every expert's gate_up and down
    swiglu_limit: float | None = None  # gpt-oss: gate clamped to <= limit, up to [-limit, limit]
    swiglu_alpha: float = 1.0  # gate * sigmoid(alpha * gate) * (up + beta); silu(gate) * up by default
    swiglu_beta: float = 0.0
    shared: DenseMLPSpec | None = None  # a dense MLP beside the experts, outputs added (Granite 4.0-H, Qwen3.5-MoE)
    shared_gate: bool = False  # Qwen3.5-MoE: the shared MLP's output x sigmoid(h @ shared_gate^T), per token

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.num_experts or self.expert_size < 1:
            raise ValueError(f"router top-k {self.experts_per_token} must be 1..{self.num_experts} experts and "
                             f"the expert width {self.expert_size} positive")
        if self.shared_gate and self.shared is None:
            raise ValueError("shared_gate gates the shared MLP of MoE layers: it needs a shared MLP")

    def leaves(self) -> list[str]:
        leaves = ["router"] + (["router_bias"] if self.router_bias else []) + ["experts.gate_up"]
        leaves += ["experts.gate_up_bias"] if self.expert_bias else []
        leaves += ["experts.down"] + (["experts.down_bias"] if self.expert_bias else [])
        leaves += self.shared.leaves() if self.shared is not None else []
        return leaves + (["shared_gate"] if self.shared_gate else [])

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        e, ie, h = self.num_experts, self.expert_size, hidden
        return {**(self.shared.shapes(hidden) if self.shared is not None else {}),
                "router": (e, h), "router_bias": (e,), "shared_gate": (1, h), "experts.gate_up": (e, 2 * ie, h),
                "experts.down": (e, h, ie), "experts.gate_up_bias": (e, 2 * ie), "experts.down_bias": (e, h)}
