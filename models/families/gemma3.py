"""Gemma 3 (text): Llama plus GELU-tanh gate, (1 + w) RMSNorms around both blocks, embeddings x
sqrt(hidden), q/k norm, and sliding layers (local RoPE base) between full ones (global base).

    config.json  model_type gemma3_text, or gemma3 (Gemma3ForConditionalGeneration: text_config, and with a
                 vision_config its SigLIP tower + Gemma3MultiModalProjector, exported as vision.onnx;
                 the tokens of one image attend to each other both ways in prefill: bidirectional_images)
    GGUF         general.architecture gemma3 (llama.cpp's converter: norms stored as 1 + w already;
                 the pattern, local base and softmax scale are llama.cpp's fixed rules unless stored)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.models.common import (f32, positive_or_none, gguf_attention, gguf_key, gguf_layers, gguf_mlp, gguf_rope, hf_attention,
                                    hf_layers, hf_mlp, hf_rope, spec_from_gguf_meta, spec_from_hf_config)
from decodert.models.layers import AttentionSpec, DenseMLPSpec, LayerSpec
from decodert.models.spec import ImageTokens, ModelSpec, RopeSpec
from decodert.models.vision import VisionSpec, siglip_weights

MODEL_TYPES = ("gemma3_text", "gemma3")
TAGS = ('vision',)
GGUF_ARCHITECTURES = ("gemma3",)

_L = "model.layers.{i}."
HF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "model.embed_tokens.weight",
    "layers.{i}.input_norm": _L + "input_layernorm.weight",
    "layers.{i}.qkv": (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
    "layers.{i}.q_norm": _L + "self_attn.q_norm.weight",
    "layers.{i}.k_norm": _L + "self_attn.k_norm.weight",
    "layers.{i}.o": _L + "self_attn.o_proj.weight",
    "layers.{i}.attn_out_norm": _L + "post_attention_layernorm.weight",
    "layers.{i}.post_norm": _L + "pre_feedforward_layernorm.weight",
    "layers.{i}.gate_up": (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    "layers.{i}.down": _L + "mlp.down_proj.weight",
    "layers.{i}.mlp_out_norm": _L + "post_feedforward_layernorm.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

_B = "blk.{i}."
GGUF_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    "embed": "token_embd.weight",
    "layers.{i}.input_norm": _B + "attn_norm.weight",
    "layers.{i}.qkv": (_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
    "layers.{i}.q_norm": _B + "attn_q_norm.weight",
    "layers.{i}.k_norm": _B + "attn_k_norm.weight",
    "layers.{i}.o": _B + "attn_output.weight",
    "layers.{i}.attn_out_norm": _B + "post_attention_norm.weight",
    "layers.{i}.post_norm": _B + "ffn_norm.weight",
    "layers.{i}.gate_up": (_B + "ffn_gate.weight", _B + "ffn_up.weight"),
    "layers.{i}.down": _B + "ffn_down.weight",
    "layers.{i}.mlp_out_norm": _B + "post_ffw_norm.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}

# transformers' Gemma3TextConfig defaults: a multimodal config.json lists only what differs.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    sliding_window_pattern=6,
)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # transformers' names of the tanh approximation
# first match wins: the vision tower's keys with or without "model." and "vision_model." (transformers 4.x / 5)
_MULTIMODAL = {"model.language_model.": "model.", "language_model.model.": "model.",
               "language_model.lm_head.": "lm_head.", "model.vision_tower.vision_model.": "model.vision_tower.",
               "vision_tower.vision_model.": "model.vision_tower.", "model.vision_tower.": "model.vision_tower.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}
_V = "model.vision_tower."
_P = "model.multi_modal_projector."
VISION_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **siglip_weights(_V),
    "vision.proj_norm": _P + "mm_soft_emb_norm.weight",
    "vision.proj": _P + "mm_input_projection_weight",  # stored [C_v, hidden]: transposed by vision_fix
}
HF_UNUSED = (r"model\.vision_tower\..*", r"model\.multi_modal_projector\..*")  # read by vision_tensor
# transformers' SiglipVisionConfig defaults and Gemma3Config's: a config.json lists only what differs
VISION_DEFAULTS: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                       hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
MM_DEFAULTS: dict[str, Any] = dict(mm_tokens_per_image=256, image_token_index=262_144)


BARE_TEXT_MODEL = ("embed_tokens.", "layers.", "norm.")  # a Gemma3TextModel saved on its own: no "model." prefix


def sanitize(key: str) -> str | None:
    """A multimodal checkpoint's keys -> the text model's names (model.*) and the vision names (model.vision_tower.*,
    model.multi_modal_projector.*, read by vision_tensor), whichever transformers version saved them; a bare text
    model's (Gemma3TextModel, EmbeddingGemma: embed_tokens.*, layers.*, norm.*) -> model.*."""
    for prefix, plain in _MULTIMODAL.items():
        if key.startswith(prefix):
            return plain + key[len(prefix):]
    if key.startswith(BARE_TEXT_MODEL):
        return "model." + key
    return key


def hf_fix(key: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Gemma's RMSNorm multiplies by (1 + w): canonical norm weights are that factor."""
    return w + np.float32(1.0) if key.endswith("norm.weight") else w


def text_config(config: dict, defaults: dict[str, Any]) -> dict:
    """The language model's settings: defaults, then text_config (gemma3) or the config itself."""
    if config.get("model_type") != "gemma3":
        return {**defaults, **config}
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DecodertError("a gemma3 config.json needs a 'text_config' object")
    top = {k: config[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in config}
    return {**defaults, **text, **top}


def gemma_layers(types: tuple[str, ...], attention: AttentionSpec, mlp: DenseMLPSpec, window: int | None,
                 local: bool) -> tuple[LayerSpec, ...]:
    """Sliding layers (``types`` "sliding": the window, and the local RoPE table where ``local``) and full ones."""
    if "sliding" in types and not window:
        raise DecodertError("sliding layers need a sliding_window")
    sliding = dataclasses.replace(attention, window=window, rope_table="rope_local" if local else "rope")
    return tuple(LayerSpec(sliding if t == "sliding" else attention, mlp) for t in types)


def hf_gemma_fields(family: str, config: dict, local: bool = False, **attention: Any) -> dict[str, Any]:
    """What Gemma 2 and 3 read alike: activation, norms, embed scale, layer pattern, scale, soft-caps;
    ``local``: the sliding layers read the local RoPE; ``attention``: more attention settings (q/k norm)."""
    # use_bidirectional_attention (EmbeddingGemma): the decoder graphs stay causal; the export writes embed.onnx with
    # the bidirectional mask and refuses the model without it (export/pipeline.py); LLM.prepare refuses to generate
    if config.get("attention_bias"):
        raise DecodertError(f"attention_bias=true is not supported for {family}")
    act = config.get("hidden_activation") or config.get("hidden_act")
    if act not in GELU_TANH:
        raise DecodertError(f"hidden_activation '{act}' is not supported for {family} (only gelu_pytorch_tanh)")
    layers = hf_layers(config)
    kinds = config.get("layer_types")
    if kinds is None:  # transformers' rule: every pattern-th layer is full
        pattern = int(config["sliding_window_pattern"])
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    if not isinstance(kinds, list) or any(k not in names for k in kinds):
        raise DecodertError(f"layer_types must list sliding_attention / full_attention per layer (got {kinds!r})")
    window = config.get("sliding_window")
    attn = hf_attention(config, scale=float(config["query_pre_attn_scalar"]) ** -0.5,
                        softcap=positive_or_none(config.get("attn_logit_softcapping")), **attention)
    return dict(
        layers=gemma_layers(tuple(names[k] for k in kinds), attn, hf_mlp(config, activation="gelu_tanh"),
                            int(window) if window else None, local),
        check_activation=False, sandwich_norm=True, embed_scale=math.sqrt(int(config["hidden_size"])),
        final_softcap=positive_or_none(config.get("final_logit_softcapping")),
    )



def hf_ropes(config: dict) -> tuple[RopeSpec, RopeSpec]:
    """(full layers' RoPE, sliding layers' RoPE), from transformers 5's per-layer-type rope_parameters
    or 4.x's rope_theta + rope_scaling (full layers only) + rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = hf_rope({"rope_parameters": params.get("full_attention") or {}, "rope_theta": config["rope_theta"]})
        local = hf_rope({"rope_parameters": params.get("sliding_attention") or {},
                         "rope_theta": config["rope_local_base_freq"]})
        return full, local
    full = hf_rope({"rope_scaling": config.get("rope_scaling"), "rope_parameters": params,
                    "rope_theta": config["rope_theta"]})
    return full, RopeSpec(theta=float(config["rope_local_base_freq"]))


def spec_from_hf(config: dict) -> ModelSpec:
    vision = _has_vision(config)
    image_token = _mm(config, "image_token_index") if vision else None
    config = text_config(config, HF_DEFAULTS)
    if image_token is not None and image_token >= int(config["vocab_size"]):
        raise DecodertError(f"config.json: image_token_index {image_token} is outside the {config['vocab_size']}-token "
                            "vocabulary (its embedding row is what the image rows replace)")
    full, local = hf_ropes(config)
    return spec_from_hf_config("gemma3", config, rope=full, local_rope=local,
                               images=ImageTokens(image_token, bidirectional=True) if vision else None,
                               **hf_gemma_fields("gemma3", config, local=True, qk_norm=True))


def _has_vision(config: dict) -> bool:
    return config.get("model_type") == "gemma3" and isinstance(config.get("vision_config"), dict)


def _mm(config: dict, key: str) -> int:
    value = config.get(key, config.get(key.replace("_index", "_id"), MM_DEFAULTS[key]))
    if not isinstance(value, int) or value < 0:
        raise DecodertError(f"config.json: {key} must be a non-negative integer (got {value!r})")
    return value


def vision_from_hf(config: dict) -> VisionSpec | None:
    """The SigLIP tower and the avg-pool projector of a gemma3 config with a vision_config, else None."""
    if not _has_vision(config):
        return None
    v = {**VISION_DEFAULTS, **config["vision_config"]}
    if v["hidden_act"] not in GELU_TANH or v["num_channels"] != 3:
        raise DecodertError(f"config.json: vision_config hidden_act '{v['hidden_act']}' / num_channels "
                            f"{v['num_channels']} is not supported (gelu_pytorch_tanh over RGB)")
    side = int(v["image_size"]) // int(v["patch_size"])
    per_side = math.isqrt(_mm(config, "mm_tokens_per_image"))
    if per_side * per_side != _mm(config, "mm_tokens_per_image") or per_side == 0 or side % per_side:
        raise DecodertError(f"config.json: mm_tokens_per_image {config.get('mm_tokens_per_image')} must be a square "
                            f"whose side divides the {side} patches per side")
    try:
        return VisionSpec(image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
                          hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
                          num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
                          layer_norm_eps=float(v["layer_norm_eps"]),
                          out_hidden=int(text_config(config, HF_DEFAULTS)["hidden_size"]),
                          scale_factor=side // per_side, connector="avg_pool")
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None


# transformers' Gemma3ImageProcessor defaults (pan-and-scan off) and Gemma3's special tokens
PROCESSOR_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size=None, resample=2, do_rescale=True, rescale_factor=1 / 255,
    do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_pan_and_scan=False)
TOKEN_DEFAULTS = dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")


def image_processor(preprocessor: dict, processor: dict, tokenizer: dict, vision: VisionSpec) -> dict[str, Any]:
    """The settings runtime/vision/gemma3.py reads: Gemma3ImageProcessor's (preprocessor_config.json), the image
    sequence length (processor_config.json) and the image tokens (tokenizer_config.json), checked."""
    settings = {k: preprocessor.get(k, v) for k, v in PROCESSOR_DEFAULTS.items()}
    if settings["do_pan_and_scan"]:
        raise DecodertError("preprocessor_config.json: do_pan_and_scan is not supported (images are resized whole)")
    size = settings["size"] or {"height": vision.image_size, "width": vision.image_size}
    if size.get("height") != vision.image_size or size.get("width") != vision.image_size:
        raise DecodertError(f"preprocessor_config.json: size {size} differs from the vision tower's image_size "
                            f"{vision.image_size}")
    if settings["resample"] not in range(6) or not settings["do_resize"]:
        raise DecodertError("preprocessor_config.json: resample must be 0..5 and do_resize true")
    seq_len = processor.get("image_seq_length", vision.tokens_per_tile)
    if seq_len != vision.tokens_per_tile:
        raise DecodertError(f"processor_config.json: image_seq_length {seq_len} differs from the "
                            f"{vision.tokens_per_tile} tokens the projector makes (mm_tokens_per_image)")
    extra = tokenizer.get("extra_special_tokens")
    extra = extra if isinstance(extra, dict) else {}
    tokens = {k: tokenizer.get(k, extra.get(k, v)) for k, v in TOKEN_DEFAULTS.items()}
    if not all(isinstance(t, str) and t for t in tokens.values()):
        raise DecodertError(f"tokenizer_config.json: boi_token / eoi_token / image_token must be strings ({tokens})")
    return {"kind": "gemma3", **settings, "size": size, **tokens, "image_seq_len": seq_len}


def vision_fix(name: str, w: np.ndarray) -> np.ndarray:
    """The projection is stored [C_v, hidden] (x @ W): canonical [hidden, C_v]; its norm multiplies by (1 + w)."""
    if name == "vision.proj":
        return np.ascontiguousarray(w.T)
    return w + np.float32(1.0) if name == "vision.proj_norm" else w


def gguf_layer_types(meta: dict, layers: int, pattern: int) -> tuple[str, ...]:
    """From `attention.sliding_window_pattern` (an int n: every n-th layer full; or one bool per
    layer, true = sliding), else llama.cpp's fixed pattern for the architecture."""
    value = gguf_key(meta, "attention.sliding_window_pattern", pattern)
    if isinstance(value, list):
        if len(value) != layers:
            raise DecodertError(f"attention.sliding_window_pattern lists {len(value)} layers, not {layers}")
        return tuple("sliding" if v else "full" for v in value)
    n = int(value)
    return tuple("sliding" if n < 1 or (i + 1) % n else "full" for i in range(layers))


def gguf_gemma_fields(meta: dict, pattern: int, large_layers: int, local: bool = False,
                      **attention: Any) -> dict[str, Any]:
    """Gemma 2 and 3 from llama.cpp metadata. llama.cpp's softmax scale: 1/sqrt(hidden / heads) for the
    27B model (``large_layers`` blocks), else 1/sqrt(head_dim); `attention.scale` wins when stored.
    ``local`` and ``attention`` as for ``hf_gemma_fields``."""
    hidden, heads = int(gguf_key(meta, "embedding_length")), int(gguf_key(meta, "attention.head_count"))
    layers, head_dim = int(gguf_key(meta, "block_count")), int(gguf_key(meta, "attention.key_length", hidden // heads))
    stored = gguf_key(meta, "attention.scale", None)
    scale = f32(stored) if stored is not None else (hidden / heads if layers == large_layers else head_dim) ** -0.5
    window = gguf_key(meta, "attention.sliding_window", None)
    attn = gguf_attention(meta, scale=scale, softcap=positive_or_none(f32(gguf_key(meta, "attn_logit_softcapping", 0.0))),
                          **attention)
    return dict(
        layers=gemma_layers(gguf_layer_types(meta, gguf_layers(meta), pattern), attn,
                            gguf_mlp(meta, activation="gelu_tanh"), int(window) if window else None, local),
        sandwich_norm=True, embed_scale=math.sqrt(hidden),
        final_softcap=positive_or_none(f32(gguf_key(meta, "final_logit_softcapping", 0.0))),
    )


def spec_from_gguf(meta: dict) -> ModelSpec:
    rope = gguf_rope(meta, gguf_attention(meta).head_dim)
    local = RopeSpec(theta=f32(gguf_key(meta, "rope.freq_base_swa", 10_000.0)), rotary_dim=rope.rotary_dim)
    return spec_from_gguf_meta("gemma3", meta, rope=rope, local_rope=local,
                               **gguf_gemma_fields(meta, pattern=6, large_layers=62, local=True, qk_norm=True))
