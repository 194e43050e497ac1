"""Qwen3.5-MoE (transformers' ``qwen3_5_moe``): Qwen3.5 (models/families/qwen3_5.py: Gated DeltaNet in
three of four layers, gated attention, the same Qwen3-VL tower without deepstack and interleaved M-RoPE with a
vision_config) whose every MLP is a mixture of experts beside a gated shared expert.

    config.json  model_type qwen3_5_moe_text, or qwen3_5_moe (text_config, vision_config, image_token_id)
    weights      model.language_model.* / model.* as Qwen3.5's; per layer mlp.gate (router [E, hidden]),
                 mlp.experts.{j}.gate_proj|up_proj|down_proj, mlp.shared_expert.{gate,up,down}_proj,
                 mlp.shared_expert_gate [1, hidden]

What the MLP declares (transformers' Qwen3NextSparseMoeBlock with Qwen3VLMoeTextTopKRouter):
- router = softmax(h @ gate^T) over ``num_experts``, the top ``num_experts_per_tok`` rescaled to sum 1
  (``MoESpec.renormalize``), SwiGLU experts of ``moe_intermediate_size`` (the MoE lowering Qwen3-MoE uses);
- plus the shared expert, a SwiGLU of ``shared_expert_intermediate_size`` (``MoESpec.shared``), times
  sigmoid(h @ shared_expert_gate^T), one gate per token (``MoESpec.shared_gate``).
"""

from __future__ import annotations

from typing import Any

from decodert.errors import DecodertError
from decodert.models.common import declared
from decodert.models.families import qwen3_5
from decodert.models.layers import DenseMLPSpec, MoESpec
from decodert.models.spec import ModelSpec
from decodert.models.vision import VisionSpec

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
TAGS = ('hybrid', 'moe', 'vision')

_M = "model.layers.{i}.mlp."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **qwen3_5.HF_WEIGHTS,
    "layers.{i}.gate_up": (_M + "shared_expert.gate_proj.weight", _M + "shared_expert.up_proj.weight"),
    "layers.{i}.down": _M + "shared_expert.down_proj.weight",
    "layers.{i}.shared_gate": _M + "shared_expert_gate.weight",
    "layers.{i}.router": _M + "gate.weight",
    # {j}: the expert; gate and up rows are interleaved into one [2 Ie, hidden] matrix per expert
    "layers.{i}.experts.gate_up": (_M + "experts.{j}.gate_proj.weight", _M + "experts.{j}.up_proj.weight"),
    "layers.{i}.experts.down": _M + "experts.{j}.down_proj.weight",
}
VISION_WEIGHTS = qwen3_5.VISION_WEIGHTS
HF_UNUSED = qwen3_5.HF_UNUSED
sanitize, hf_fix, video_processor = qwen3_5.sanitize, qwen3_5.hf_fix, qwen3_5.video_processor
# transformers' Qwen3_5MoeTextConfig defaults beyond Qwen3.5's (hidden 2048, 40 layers, 256 experts, top 8)
MOE_DEFAULTS: dict[str, Any] = dict(hidden_size=2048, num_hidden_layers=40, num_experts=256, num_experts_per_tok=8,
                                    moe_intermediate_size=512, shared_expert_intermediate_size=512)


def _mlp(text: dict) -> MoESpec:
    """The experts and the gated shared expert of every layer."""
    try:
        experts, top = int(text["num_experts"]), int(text["num_experts_per_tok"])
        width, shared = int(text["moe_intermediate_size"]), int(text["shared_expert_intermediate_size"])
    except (TypeError, ValueError):
        raise DecodertError("config.json: qwen3_5_moe num_experts / num_experts_per_tok / moe_intermediate_size / "
                            "shared_expert_intermediate_size must be integers") from None
    if experts < 1 or shared < 1:
        raise DecodertError(f"config.json: qwen3_5_moe needs experts ({experts}) and a shared expert ({shared} wide)")
    return declared(MoESpec, experts, top, width, renormalize=True, shared=declared(DenseMLPSpec, shared), shared_gate=True)


def _with_defaults(config: dict) -> dict:
    if config.get("model_type") in qwen3_5.IMAGE_TEXT:
        return {**config, "text_config": {**MOE_DEFAULTS, **(config.get("text_config") or {})}}
    return {**MOE_DEFAULTS, **config}


def spec_from_hf(config: dict) -> ModelSpec:
    try:
        return qwen3_5.spec_from_hf(_with_defaults(config), family="qwen3_5_moe", mlp=_mlp)
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None


def vision_from_hf(config: dict) -> VisionSpec | None:
    """Qwen3.5's tower (the same Qwen3_5VisionModel), for a qwen3_5_moe config with a vision_config."""
    return qwen3_5.vision_from_hf(_with_defaults(config))
