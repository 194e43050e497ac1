"""Qwen3-MoE: Qwen3's attention; the MLP of most layers is a mixture of SwiGLU experts.

    router  = softmax(h @ gate^T)                 [T, E] float32
    top-k   = the k largest; rescaled to sum 1 when norm_topk_prob (else the softmax values)
    y       = sum_k w_k * down_e(silu(gate_e(h)) * up_e(h))

Layers in ``mlp_only_layers``, and every layer when ``(i + 1) % decoder_sparse_step != 0``, keep a
dense MLP of ``intermediate_size``. Checkpoints store each expert's gate/up/down as its own tensor
(``mlp.experts.{j}.gate_proj.weight``); the table reads them one expert at a time, so an export never
holds a layer's experts in float32 at once.
"""

from __future__ import annotations

from typing import Callable

from decodert.errors import DecodertError
from decodert.models.families import qwen3
from decodert.models.common import declared, gguf_key, hf_attention, hf_mlp, spec_from_gguf_meta, spec_from_hf_config
from decodert.models.families.qwen2 import reject_sliding_layers
from decodert.models.layers import LayerSpec, MoESpec
from decodert.models.spec import ModelSpec

MODEL_TYPES = ("qwen3_moe",)
TAGS = ('moe',)
GGUF_ARCHITECTURES = ("qwen3moe",)

_M = "model.layers.{i}.mlp."
HF_WEIGHTS = {
    **qwen3.HF_WEIGHTS,
    "layers.{i}.router": _M + "gate.weight",
    # {j}: the expert; gate and up rows are interleaved into one [2 Ie, hidden] matrix per expert
    "layers.{i}.experts.gate_up": (_M + "experts.{j}.gate_proj.weight", _M + "experts.{j}.up_proj.weight"),
    "layers.{i}.experts.down": _M + "experts.{j}.down_proj.weight",
}
_B = "blk.{i}."
GGUF_WEIGHTS = {
    **qwen3.GGUF_WEIGHTS,
    "layers.{i}.router": _B + "ffn_gate_inp.weight",
    # stacked [E, ...] tensors: {j} selects the expert's slice
    "layers.{i}.experts.gate_up": (_B + "ffn_gate_exps.weight[{j}]", _B + "ffn_up_exps.weight[{j}]"),
    "layers.{i}.experts.down": _B + "ffn_down_exps.weight[{j}]",
}


def _is_moe(sparse_step: int, dense: list) -> Callable[[int], bool]:
    if sparse_step < 1:
        raise DecodertError(f"decoder_sparse_step {sparse_step} must be >= 1")
    return lambda i: i not in dense and (i + 1) % sparse_step == 0


def spec_from_hf(config: dict) -> ModelSpec:
    if config.get("attention_bias"):
        raise DecodertError("attention_bias=true is not supported for qwen3_moe")
    reject_sliding_layers(config)
    experts = config.get("num_experts", config.get("num_local_experts"))
    if not experts:
        raise DecodertError("qwen3_moe config has no num_experts (a router needs experts)")
    if config.get("shared_expert_intermediate_size"):
        raise DecodertError("qwen3_moe with a shared expert (shared_expert_intermediate_size) is not supported")
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise DecodertError(f"mlp_only_layers {mlp_only!r} must be a list of layer indices")
    moe = declared(MoESpec, int(experts), int(config.get("num_experts_per_tok", 8)), int(config.get("moe_intermediate_size", 0)),
                  renormalize=bool(config.get("norm_topk_prob", False)))
    is_moe = _is_moe(int(config.get("decoder_sparse_step", 1)), mlp_only)
    attention, dense = hf_attention(config, qk_norm=True), hf_mlp(config)
    return spec_from_hf_config("qwen3_moe", config, lambda i: LayerSpec(attention, moe if is_moe(i) else dense),
                               check_moe=False)


def spec_from_gguf(meta: dict) -> ModelSpec:
    moe = declared(MoESpec, int(gguf_key(meta, "expert_count")), int(gguf_key(meta, "expert_used_count")),
                  int(gguf_key(meta, "expert_feed_forward_length")),
                  renormalize=True)  # llama.cpp's qwen3moe graph always renormalizes the top-k weights
    return spec_from_gguf_meta("qwen3_moe", meta, attention={"qk_norm": True}, mlp=moe, check_moe=False)
