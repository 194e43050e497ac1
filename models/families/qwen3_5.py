"""Qwen3.5 (text): Gated DeltaNet linear attention in three of every four layers, gated full attention
in the fourth.

    config.json  model_type qwen3_5_text, or qwen3_5 (an image-text checkpoint: text_config, vision_config,
                 image_token_id; model.language_model.*, model.visual.* and mtp.* weights: the MTP layer is left out
                 of the target and exported as a draft head of its own, ``MTP_WEIGHTS`` below)
    GGUF         general.architecture qwen35, as llama.cpp's converter writes it (conversion/qwen.py):
                 ssm_a = -exp(A_log), the conv squeezed to [C, K], (1 + w) norms stored as the factor
                 (not ssm_norm), value heads reordered from grouped-by-key-head to tiled when Hv > Hk;
                 ``gguf_fix`` undoes each of these

What differs from Qwen3 (transformers' ``modeling_qwen3_5.py``):
- ``layer_types``: "linear_attention" layers (``layer_kinds`` "linear_attention": a causal conv over
  q/k/v with a rolling state, the gated delta rule over a recurrent state, a gated RMSNorm) and
  "full_attention" layers;
- full attention: q_proj yields a query and an output gate per head (rows interleaved per head,
  de-interleaved at load into q rows then gate rows), y = attention * sigmoid(gate)
  (``attn_output_gate``); q/k RMSNorm; RoPE on the first quarter of each head (partial rotary;
  text-only M-RoPE is plain RoPE: its three position streams are equal);
- every RMSNorm multiplies by (1 + w) (canonical norm weights are that factor), except the gated
  RMSNorm of the linear layers, which multiplies by w.

With a ``vision_config`` (model_type qwen3_5: ``Qwen3_5ForConditionalGeneration``) the model sees images, and what
it declares is Qwen3-VL's (models/families/qwen3_vl.py) less deepstack:
- the tower is ``qwen3_vit`` (transformers' Qwen3_5VisionModel is Qwen3VLVisionModel without its deepstack
  mergers: learned positions resampled per image, LayerNorm + GELU-tanh blocks, the 2x2 merger with its
  LayerNorm before the merge), so ``VisionSpec.deepstack`` is empty and the prefill takes no deepstack rows;
- the text model's rotary is interleaved M-RoPE (``mrope_section``, default 11/11/10 pairs of the quarter-head
  rotary; Qwen3_5TextRotaryEmbedding interleaves whatever ``mrope_interleaved`` says) over get_rope_index's
  positions, which are Qwen3-VL's for images (runtime/vision/mrope.py);
- the processor is Qwen3VLProcessor over Qwen2VLImageProcessor (transformers' AutoProcessor for qwen3_5):
  ``<|image_pad|>`` x (h/32 * w/32) between <|vision_start|> and <|vision_end|>; image_token_id from config.json;
  videos as Qwen3-VL's (``video_processor``: Qwen3VLVideoProcessor, runtime/vision/qwen_video.py).
Without a vision_config (qwen3_5_text, or a qwen3_5 config.json that has none) the model is text-only as before:
plain partial RoPE, no image inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from decodert.errors import DecodertError
from decodert.models.common import (declared, gguf_attention, gguf_key, gguf_layers, gguf_mlp, hf_attention, hf_mlp, hf_rope,
                                    partial_rotary_factor, spec_from_gguf_meta, spec_from_hf_config)
from decodert.models.families import qwen3_vl
from decodert.models.rope import RopeSpec
from decodert.models.layers import AttentionSpec, GatedDeltaNetSpec, LayerSpec, MLPSpec, MoESpec
from decodert.models.spec import ImageTokens, ModelSpec, MRopeSpec
from decodert.models.vision import VisionSpec

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
TAGS = ('hybrid', 'vision')
GGUF_ARCHITECTURES = ("qwen35",)

_L = "model.layers.{i}."
_A = _L + "self_attn."
_D = _L + "linear_attn."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.qkv": (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"),
    "layers.{i}.q_norm": _A + "q_norm.weight",
    "layers.{i}.k_norm": _A + "k_norm.weight",
    "layers.{i}.o": _A + "o_proj.weight",
    "layers.{i}.linear_in": (_D + "in_proj_qkv.weight", _D + "in_proj_z.weight", _D + "in_proj_b.weight",
                             _D + "in_proj_a.weight"),
    "layers.{i}.linear_conv": _D + "conv1d.weight",
    "layers.{i}.linear_a_log": _D + "A_log",
    "layers.{i}.linear_dt_bias": _D + "dt_bias",
    "layers.{i}.linear_norm": _D + "norm.weight",
    "layers.{i}.linear_out": _D + "out_proj.weight",
    "layers.{i}.post_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.gate_up": (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    "layers.{i}.down": _L + "mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {  # gguf.get_tensor_name_map(MODEL_ARCH.QWEN35, n)
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": (_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
    "layers.{i}.q_norm": _B + "attn_q_norm.weight",
    "layers.{i}.k_norm": _B + "attn_k_norm.weight",
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.linear_in": (_B + "attn_qkv.weight", _B + "attn_gate.weight", _B + "ssm_beta.weight",
                             _B + "ssm_alpha.weight"),
    "layers.{i}.linear_conv": _B + "ssm_conv1d.weight",
    "layers.{i}.linear_a_log": _B + "ssm_a",
    "layers.{i}.linear_dt_bias": _B + "ssm_dt.bias",
    "layers.{i}.linear_norm": _B + "ssm_norm.weight",
    "layers.{i}.linear_out": _B + "ssm_out.weight",
    "layers.{i}.post_norm": _B + "post_attention_norm.weight",
    "layers.{i}.gate_up": (_B + "ffn_gate.weight", _B + "ffn_up.weight"),
    "layers.{i}.down": _B + "ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}

# transformers' Qwen3_5TextConfig defaults, for a config.json that leaves some out
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248_320, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32_768, rms_norm_eps=1e-6, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, tie_word_embeddings=False,
)
KINDS = {"linear_attention": "linear_attention", "full_attention": "attention"}
_MULTIMODAL = {"model.language_model.": "model.", "model.visual.": "visual."}
_DROPPED = ("mtp.",)
VISION_WEIGHTS = qwen3_vl.VISION_WEIGHTS  # visual.*: the qwen3_vit tower's names (deepstack entries never read)
HF_UNUSED = (r"visual\..*",)  # read by vision_tensor (an image-text checkpoint), not by the text model
# transformers' Qwen3_5VisionConfig / Qwen3_5Config defaults: a config.json lists only what differs
VISION_DEFAULTS: dict[str, Any] = {**qwen3_vl.VISION_DEFAULTS, "deepstack_visual_indexes": []}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 248_056, 248_057
IMAGE_TEXT = ("qwen3_5", "qwen3_5_moe")  # model types whose config.json nests text_config (and vision_config)
MROPE_SECTION = [11, 11, 10]
_ONE_PLUS_W = ("layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight", "model.norm.weight")


def sanitize(key: str) -> str | None:
    """An image-text checkpoint's keys -> the text model's (model.*) and the tower's (visual.*); MTP keys dropped."""
    if key.startswith(_DROPPED):
        return None
    for prefix, plain in _MULTIMODAL.items():
        if key.startswith(prefix):
            return plain + key[len(prefix):]
    return key


def hf_fix(key: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """(1 + w) norms -> their factor; q_proj's per-head [query | gate] rows -> all query rows, then all gate rows."""
    if key.endswith(_ONE_PLUS_W):
        return w + np.float32(1.0)
    if key.endswith("self_attn.q_proj.weight"):
        return _query_then_gate(w, spec)
    return w


def _query_then_gate(w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    h, d = spec.num_heads, spec.head_dim
    heads = w.reshape(h, 2, d, -1)
    return np.concatenate([heads[:, 0].reshape(h * d, -1), heads[:, 1].reshape(h * d, -1)], axis=0)


def delta_net(spec: ModelSpec) -> GatedDeltaNetSpec:
    """The model's Gated DeltaNet layers' spec (one for every linear_attention layer)."""
    return next(layer.mixer for layer in spec.layers if isinstance(layer.mixer, GatedDeltaNetSpec))


def _grouped(w: np.ndarray, spec: ModelSpec, head_dim: int, axis: int = 0) -> np.ndarray:
    """Value heads in llama.cpp's tiled order (k0, k1, .., k0, k1, ..) -> transformers' grouped order (each key
    head's value heads together), along ``axis``."""
    hk, hv = delta_net(spec).key_heads, delta_net(spec).value_heads
    if hk == hv:
        return w
    x = np.moveaxis(w, axis, 0)
    x = x.reshape(hv // hk, hk, head_dim, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(x, 0, axis)


def gguf_fix(key: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Undo llama.cpp's converter: de-interleave q and gate, A_log from -exp(A_log), value heads grouped again."""
    d = delta_net(spec)
    kd, dv = d.key_heads * d.key_dim, d.value_dim
    if key.endswith("attn_q.weight"):
        return _query_then_gate(w, spec)
    if key.endswith("ssm_a"):
        w = np.log(-w)
    if key.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
        return np.concatenate([w[: 2 * kd], _grouped(w[2 * kd:], spec, dv)], axis=0)
    if key.endswith("attn_gate.weight"):
        return _grouped(w, spec, dv)
    if key.endswith(("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias")):
        return _grouped(w, spec, 1)
    if key.endswith("ssm_out.weight"):
        return _grouped(w, spec, dv, axis=1)
    return w


def gguf_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The conv's taps are stored squeezed, [C, K]; canonical is the checkpoint's [C, 1, K]."""
    return (shape[0], 1, shape[1]) if key.endswith("ssm_conv1d.weight") and len(shape) == 2 else shape


def text_config(config: dict) -> dict:
    """The language model's settings: defaults, then text_config (qwen3_5, qwen3_5_moe) or the config itself."""
    if config.get("model_type") not in IMAGE_TEXT:
        return {**HF_DEFAULTS, **config}
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DecodertError(f"a {config['model_type']} config.json needs a 'text_config' object")
    top = {k: config[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in config}
    return {**HF_DEFAULTS, **text, **top}


def layer_kinds(config: dict) -> tuple[str, ...]:
    """"linear_attention" / "attention" per layer, from layer_types or transformers' every-4th rule."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise DecodertError(f"layer_types must list {layers} layers")
    unknown = [t for t in types if t not in KINDS]
    if unknown:
        raise DecodertError(f"layer kind '{unknown[0]}' is not supported for qwen3_5 (known: {', '.join(KINDS)})")
    return tuple(KINDS[t] for t in types)


def has_vision(config: dict) -> bool:
    return config.get("model_type") in IMAGE_TEXT and isinstance(config.get("vision_config"), dict)


def spec_from_hf(config: dict, family: str = "qwen3_5", mlp: Callable[[dict], MLPSpec] | None = None) -> ModelSpec:
    """``family``, ``mlp(text config) -> every layer's MLP``: what a variant declares (qwen3_5_moe.py)."""
    vision = has_vision(config)
    image_token = config.get("image_token_id", IMAGE_TOKEN_ID)
    config = text_config(config)
    if config.get("attention_bias"):
        raise DecodertError(f"attention_bias=true is not supported for {family}")
    params = config.get("rope_parameters") or {}
    section = params.get("mrope_section") or MROPE_SECTION
    config = {**config, "rope_parameters": {k: v for k, v in params.items() if k not in ("mrope_section",
                                                                                          "mrope_interleaved")}}
    kinds = layer_kinds(config)
    delta = declared(GatedDeltaNetSpec, int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"]),
                              int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"]),
                              kernel=int(config["linear_conv_kernel_dim"]))
    layer_mlp = mlp(config) if mlp else hf_mlp(config)
    spec = spec_from_hf_config(family, config, _layers(kinds, hf_attention(config, **ATTENTION), delta, layer_mlp),
                               check_moe=not isinstance(layer_mlp, MoESpec))
    factor = partial_rotary_factor({"partial_rotary_factor": 0.25, **config})
    rot = int(spec.head_dim * factor)
    rope = hf_rope(config)
    spec = dataclasses.replace(spec, rope=rope if rot == spec.head_dim else dataclasses.replace(rope, rotary_dim=rot))
    return _with_images(spec, image_token, section) if vision else spec


def _with_images(spec: ModelSpec, image_token: Any, section: Any) -> ModelSpec:
    """An image-text model's text half: the image token's rows replaced, interleaved M-RoPE."""
    if not isinstance(image_token, int) or not 0 <= image_token < spec.vocab_size:
        raise DecodertError(f"config.json: image_token_id {image_token!r} must be a token of the {spec.vocab_size}-token "
                            "vocabulary (its embedding row is what the image rows replace)")
    if not isinstance(section, list) or not all(isinstance(x, int) for x in section):
        raise DecodertError(f"config.json: rope_parameters mrope_section {section!r} must be a list of 3 integers")
    try:
        return dataclasses.replace(spec, images=ImageTokens(image_token), mrope=MRopeSpec(tuple(section), interleaved=True))
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None


def video_processor(config: dict) -> dict[str, Any]:
    """Qwen3-VL's video rule (AutoVideoProcessor's Qwen3VLVideoProcessor for qwen3_5: 2 frames a second,
    timestamped slices; Qwen3_5Model.get_rope_index splits a video into its frames as Qwen3-VL's does)."""
    return qwen3_vl.video_processor({**config, "video_token_id": config.get("video_token_id", VIDEO_TOKEN_ID)})


def vision_from_hf(config: dict) -> VisionSpec | None:
    """The Qwen3-VL tower without deepstack, for a qwen3_5 config with a vision_config; else None (text-only)."""
    if not has_vision(config):
        return None
    tower = qwen3_vl.tower_from_hf({**VISION_DEFAULTS, **config["vision_config"]}, ())
    hidden = int(text_config(config)["hidden_size"])
    if tower.out_hidden != hidden:
        raise DecodertError(f"config.json: vision_config out_hidden_size {tower.out_hidden} differs from the text "
                            f"model's hidden_size {hidden} (the image rows replace token embeddings)")
    return tower


def spec_from_gguf(meta: dict) -> ModelSpec:
    """llama.cpp's keys: the attention's as for Qwen3, the linear layers' under ssm.*, every
    full_attention_interval-th layer full (llama.cpp's rule)."""
    layers = gguf_layers(meta)
    interval = int(gguf_key(meta, "full_attention_interval", 4))
    kinds = tuple("attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    hv, inner = int(gguf_key(meta, "ssm.time_step_rank")), int(gguf_key(meta, "ssm.inner_size"))
    if hv < 1 or inner % hv:
        raise DecodertError(f"qwen35.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {hv}")
    delta = declared(GatedDeltaNetSpec, int(gguf_key(meta, "ssm.group_count")), hv, int(gguf_key(meta, "ssm.state_size")),
                              inner // hv, kernel=int(gguf_key(meta, "ssm.conv_kernel")))
    return spec_from_gguf_meta("qwen3_5", meta, _layers(kinds, gguf_attention(meta, **ATTENTION), delta, gguf_mlp(meta)))


ATTENTION = dict(qk_norm=True, output_gate=True)  # gated attention: q_proj also yields a gate per head


def _layers(kinds: tuple[str, ...], attention: AttentionSpec, delta: GatedDeltaNetSpec,
            mlp: MLPSpec) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(attention if kind == "attention" else delta, mlp) for kind in kinds)


# ---- the MTP layer (multi-token prediction), a draft head of its own (export/heads/qwen3_5_mtp.py) ----------------
# The published checkpoints' mtp.* tensors (mtp_num_hidden_layers: 1), which transformers does not load; the embedding
# and lm_head are the target's. One step, for the pair (h_p: the target's hidden state at position p, after its final
# norm; t: the token at p + 1), every RMSNorm (1 + w):
#     x   = fc([pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h_p)])      [2 hidden] -> [hidden]
#     x   = a full-attention decoder layer of the target's kind (gated attention, q/k norm, partial RoPE at
#           position p, its own K/V), then its MLP (the target's kind: SwiGLU, or qwen3_5_moe.py's experts and
#           gated shared expert, MTP_MOE_WEIGHTS), each with its residual
#     h'  = mtp.norm(x);  logits = lm_head(h')   (h' is the next step's h, at position p + 1)
_M = "mtp.layers.0."
MTP_WEIGHTS: dict[str, str] = {
    "fc": "mtp.fc.weight",  # [hidden, 2 hidden]: embedding columns first, then the hidden state's
    "embed_norm": "mtp.pre_fc_norm_embedding.weight",
    "hidden_norm": "mtp.pre_fc_norm_hidden.weight",
    "input_norm": _M + "input_layernorm.weight",
    "q": _M + "self_attn.q_proj.weight",  # per head [query | gate] rows, as the target's
    "k": _M + "self_attn.k_proj.weight",
    "v": _M + "self_attn.v_proj.weight",
    "o": _M + "self_attn.o_proj.weight",
    "q_norm": _M + "self_attn.q_norm.weight",
    "k_norm": _M + "self_attn.k_norm.weight",
    "post_norm": _M + "post_attention_layernorm.weight",
    "gate": _M + "mlp.gate_proj.weight",
    "up": _M + "mlp.up_proj.weight",
    "down": _M + "mlp.down_proj.weight",
    "final_norm": "mtp.norm.weight",
    "lm_head": "lm_head.weight",  # the target's (its embedding where tied)
}
MTP_DENSE = ("gate", "up", "down")  # the MLP of a dense target's MTP layer
MTP_MOE_WEIGHTS: dict[str, str] = {  # a MoE target's (qwen3_5_moe.py): its experts beside a gated shared expert
    "router": _M + "mlp.gate.weight",  # [E, hidden]
    "experts.gate": _M + "mlp.experts.{j}.gate_proj.weight",  # [Ie, hidden] per expert
    "experts.up": _M + "mlp.experts.{j}.up_proj.weight",
    "experts.down": _M + "mlp.experts.{j}.down_proj.weight",  # [hidden, Ie]
    "shared.gate": _M + "mlp.shared_expert.gate_proj.weight",
    "shared.up": _M + "mlp.shared_expert.up_proj.weight",
    "shared.down": _M + "mlp.shared_expert.down_proj.weight",
    "shared_gate": _M + "mlp.shared_expert_gate.weight",  # [1, hidden]: x sigmoid(h @ shared_gate^T)
}
MTP_MODEL_TYPES = MODEL_TYPES + ("qwen3_5_moe_text", "qwen3_5_moe")  # qwen3_5_moe.py: the same layer, MoE MLP
MTP_ONE_PLUS_W = ("embed_norm", "hidden_norm", "input_norm", "q_norm", "k_norm", "post_norm", "final_norm")


@dataclasses.dataclass(frozen=True)
class MtpSpec:
    """What the MTP head's graph needs (the target's attention and MLP sizes, its RoPE)."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec  # the target's (partial: rotary_dim)
    moe: MoESpec | None = None  # a MoE target's MTP layer: its experts (and shared expert), as the target's layers


def mtp_spec(config: dict, target: ModelSpec) -> MtpSpec:
    """The MTP head's spec from the target's config.json and spec (its family's ``spec_from_hf``: qwen3_5 or
    qwen3_5_moe); more than one MTP layer refused in one line."""
    text = text_config(config)
    layers = int(text.get("mtp_num_hidden_layers", 1) or 0)
    if layers != 1:
        raise DecodertError(f"qwen3_5 MTP: mtp_num_hidden_layers {layers} is not supported (one MTP layer)")
    if str(text.get("hidden_act", "silu")) != "silu":
        raise DecodertError(f"qwen3_5 MTP: hidden_act {text.get('hidden_act')!r} is not supported (silu)")
    return MtpSpec(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                   num_heads=int(text["num_attention_heads"]), num_kv_heads=int(text["num_key_value_heads"]),
                   head_dim=int(text["head_dim"]), intermediate_size=int(text["intermediate_size"]),
                   rms_norm_eps=float(text["rms_norm_eps"]), rope=target.rope,
                   moe=target.mlp(0) if isinstance(target.mlp(0), MoESpec) else None)
