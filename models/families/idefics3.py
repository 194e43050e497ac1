"""Idefics3 / SmolVLM: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model.

    config.json  model_type idefics3 (SmolVLM-256M/500M/2B) or smolvlm (SmolVLM2): ``text_config`` is a
                 Llama config, ``vision_config`` the SigLIP tower, ``scale_factor`` the pixel shuffle,
                 ``image_token_id`` the ``<image>`` token the image embeddings replace
    weights      model.text_model.* (the Llama text model), model.vision_model.*, model.connector.*

The text model is Llama's (models/families/llama.py tables, keys renamed by ``sanitize``); the vision tower is
declared by ``vision_from_hf`` and ``VISION_WEIGHTS`` (models/vision.py) and exported as vision.onnx.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decodert.errors import DecodertError
from decodert.models.families import llama
from decodert.models.spec import ImageTokens, ModelSpec
from decodert.models.vision import VisionSpec, siglip_weights

MODEL_TYPES = ("idefics3", "smolvlm")
TAGS = ('vision',)

HF_WEIGHTS = llama.HF_WEIGHTS
_V = "model.vision_model."
VISION_WEIGHTS: dict[str, str | tuple[str, ...]] = {
    **siglip_weights(_V),
    "vision.proj": "model.connector.modality_projection.proj.weight",
}
# transformers' Idefics3VisionConfig defaults: a config.json lists only what differs
VISION_DEFAULTS: dict[str, Any] = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=16, image_size=224, patch_size=32, layer_norm_eps=1e-6,
                                       hidden_act="gelu_pytorch_tanh", num_channels=3)
_TEXT = "model.text_model."
HF_UNUSED = (r"model\.vision_model\..*", r"model\.connector\..*")  # read by vision_tensor, not the text model


def sanitize(key: str) -> str | None:
    """The text model's keys -> Llama's names; the vision keys stay as they are (VISION_WEIGHTS)."""
    return "model." + key[len(_TEXT):] if key.startswith(_TEXT) else key


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DecodertError("config.json: an idefics3 model needs a 'text_config' object")
    if text.get("model_type", "llama") != "llama":
        raise DecodertError(f"config.json: text_config.model_type '{text.get('model_type')}' is not supported "
                            "for idefics3 (Llama text models only)")
    return {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def spec_from_hf(config: dict) -> ModelSpec:
    image_token = config.get("image_token_id")
    if not isinstance(image_token, int):
        raise DecodertError("config.json: an idefics3 model needs an integer 'image_token_id'")
    spec = llama.spec_from_hf(_text_config(config))
    return dataclasses.replace(spec, family="idefics3", images=ImageTokens(image_token))


def vision_from_hf(config: dict) -> VisionSpec:
    v = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
    if v["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_new") or v["num_channels"] != 3:
        raise DecodertError(f"config.json: vision_config hidden_act '{v['hidden_act']}' / num_channels "
                            f"{v['num_channels']} is not supported (gelu_pytorch_tanh over RGB)")
    try:
        return VisionSpec(image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
                          hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
                          num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
                          layer_norm_eps=float(v["layer_norm_eps"]),
                          out_hidden=int(_text_config(config)["hidden_size"]),
                          scale_factor=int(config.get("scale_factor", 2)))
    except ValueError as e:
        raise DecodertError(f"config.json: {e}") from None

