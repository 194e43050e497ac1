"""The frozen description of a vision tower + projector (``vision.onnx``), beside the text ``ModelSpec``.

A vision-language family (models/families/idefics3.py) declares ``vision_from_hf(config) -> VisionSpec`` and
``VISION_WEIGHTS`` (canonical vision name -> checkpoint key). The text model's ``ModelSpec`` carries
only ``image_token_id``: the token whose embedding rows the image embeddings replace in prefill.

Canonical vision weights (linear weights in checkpoint layout [out, in]):

- ``vision.patch_embed``            [C_v, 3, P, P]   a Conv with stride P (the patches)
- ``vision.patch_embed_bias``       [C_v]
- ``vision.pos_embed``              [(S/P)^2, C_v]   one row per patch of a full tile
- ``vision.layers.{i}.ln1[_bias]``  [C_v]            LayerNorm before attention
- ``vision.layers.{i}.qkv[_bias]``  [3 C_v, C_v] / [3 C_v]   rows q, k, v (fused at load)
- ``vision.layers.{i}.o[_bias]``    [C_v, C_v] / [C_v]
- ``vision.layers.{i}.ln2[_bias]``  [C_v]            LayerNorm before the MLP
- ``vision.layers.{i}.fc1[_bias]``  [I_v, C_v] / [I_v]
- ``vision.layers.{i}.fc2[_bias]``  [C_v, I_v] / [C_v]
- ``vision.post_ln[_bias]``         [C_v]
- ``vision.proj``                   [hidden, C_v * r^2]   after the pixel shuffle by r (no bias)

The ``qwen_vit`` tower (Qwen2.5-VL: variable-size images as patch rows, RMSNorm, SwiGLU, 2x2 merger) names:

- ``vision.patch_embed``             [C_v, 3 T P P]   the Conv3d over (channel, frame, row, column) as a linear
- ``vision.layers.{i}.norm1|norm2``  [C_v]            RMSNorm weights
- ``vision.layers.{i}.qkv[_bias]``, ``o[_bias]``       as above
- ``vision.layers.{i}.gate_up[_bias]`` [2 I_v, C_v]   rows gate | up (fused at load);  ``down[_bias]`` [C_v, I_v]
- ``vision.merger_norm`` [C_v];  ``vision.merger_fc1[_bias]`` [4 C_v, 4 C_v];  ``vision.merger_fc2[_bias]`` [hidden, 4 C_v]

The ``qwen3_vit`` tower (Qwen3-VL: full attention, LayerNorm + GELU-tanh blocks, learned positions) names
``vision.patch_embed[_bias]``, ``vision.pos_embed`` [num_positions, C_v], the SigLIP layer names above, the
merger's (``merger_norm[_bias]`` over C_v) and per deepstack layer j ``vision.deepstack.layers.{j}.norm[_bias]``
[4 C_v], ``.fc1[_bias]``, ``.fc2[_bias]`` (a merger whose LayerNorm runs after the 2x2 merge).
The connector between the tower and the text model (``VisionSpec.connector``):

- ``pixel_shuffle`` (Idefics3): r*r neighbouring patches -> one token of C_v * r^2, then ``vision.proj``
- ``avg_pool`` (Gemma 3): r x r average pooling of the patch grid, an RMSNorm (``vision.proj_norm`` [C_v], the
  (1 + w) factor), then ``vision.proj`` [hidden, C_v]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


CONNECTORS = ("pixel_shuffle", "avg_pool")


@dataclass(frozen=True)
class VisionSpec:
    """A SigLIP-style encoder over square tiles, a pixel shuffle and a linear projector."""

    image_size: int  # S: side of one tile in pixels
    patch_size: int  # P
    hidden_size: int  # C_v
    intermediate_size: int  # I_v
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    out_hidden: int  # the text model's hidden size
    scale_factor: int = 1  # r: r*r neighbouring patches -> one token (pixel shuffle, avg pooling; qwen: the merge)
    activation: str = "gelu_tanh"
    connector: str = "pixel_shuffle"  # or "avg_pool" (see the module docstring)
    tower: str = "siglip"  # "siglip" (square tiles) | "qwen_vit" / "qwen3_vit" (patch rows of any size; image_size = P * r)
    temporal_patch_size: int = 1  # qwen_vit: frames per patch (an image is repeated)
    window_size: int = 0  # qwen_vit: window attention over window_size^2 pixels, except in full_layers
    full_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0  # qwen_vit: the 2-D rotary of the attention (rows, columns)
    num_positions: int = 0  # qwen3_vit: learned position table (a square grid, bilinearly resampled per image)
    deepstack: tuple[int, ...] = ()  # qwen3_vit: layers whose merged output feeds the text model's first layers

    def __post_init__(self) -> None:
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size} "
                             f"and of scale_factor {self.scale_factor} patches")
        if self.connector not in CONNECTORS:
            raise ValueError(f"vision connector '{self.connector}' is not one of {CONNECTORS}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of its {self.num_heads} heads")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Text positions one tile becomes: (S/P)^2 / r^2."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def patch_features(self) -> int:
        """Values in one patch row (qwen_vit): 3 T P P."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionSpec":
        d = dict(d)
        d["full_layers"] = tuple(d.get("full_layers", ()))
        d["deepstack"] = tuple(d.get("deepstack", ()))
        return cls(**d)


def vision_names(v: VisionSpec) -> list[str]:
    """Canonical vision weight names, in weights.bin order."""
    if v.tower == "qwen_vit":
        names = ["vision.patch_embed"]
        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            names += [p + n for n in ("norm1", "qkv", "qkv_bias", "o", "o_bias", "norm2", "gate_up", "gate_up_bias",
                                      "down", "down_bias")]
        return names + ["vision.merger_norm", "vision.merger_fc1", "vision.merger_fc1_bias", "vision.merger_fc2",
                        "vision.merger_fc2_bias"]
    names = ["vision.patch_embed", "vision.patch_embed_bias", "vision.pos_embed"]
    for i in range(v.num_layers):
        p = f"vision.layers.{i}."
        names += [p + n for n in ("ln1", "ln1_bias", "qkv", "qkv_bias", "o", "o_bias", "ln2", "ln2_bias",
                                  "fc1", "fc1_bias", "fc2", "fc2_bias")]
    if v.tower == "qwen3_vit":
        merger = ("norm", "norm_bias", "fc1", "fc1_bias", "fc2", "fc2_bias")
        names += ["vision.merger_" + n for n in merger]
        return names + [f"vision.deepstack.layers.{j}.{n}" for j in range(len(v.deepstack)) for n in merger]
    norm = ["vision.proj_norm"] if v.connector == "avg_pool" else []
    return names + ["vision.post_ln", "vision.post_ln_bias", *norm, "vision.proj"]


def vision_shape(v: VisionSpec, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical vision weight."""
    c, inter = v.hidden_size, v.intermediate_size
    leaf = name.rsplit(".", 1)[-1]
    if v.tower == "qwen_vit":
        merged = c * v.scale_factor ** 2
        qwen = {"patch_embed": (c, v.patch_features), "qkv": (3 * c, c), "qkv_bias": (3 * c,), "o": (c, c),
                "gate_up": (2 * inter, c), "gate_up_bias": (2 * inter,), "down": (c, inter),
                "merger_fc1": (merged, merged), "merger_fc1_bias": (merged,), "merger_fc2": (v.out_hidden, merged),
                "merger_fc2_bias": (v.out_hidden,)}
        return qwen.get(leaf, (c,))
    if v.tower == "qwen3_vit":
        merged = c * v.scale_factor ** 2
        deep = ".deepstack." in name
        qwen3 = {"patch_embed": (c, v.patch_features), "pos_embed": (v.num_positions, c), "qkv": (3 * c, c),
                 "qkv_bias": (3 * c,), "o": (c, c), "fc1": (inter, c), "fc1_bias": (inter,), "fc2": (c, inter),
                 "merger_fc1": (merged, merged), "merger_fc1_bias": (merged,), "merger_fc2": (v.out_hidden, merged),
                 "merger_fc2_bias": (v.out_hidden,), "norm": (merged,), "norm_bias": (merged,)}
        if deep and leaf.startswith("fc"):
            leaf = "merger_" + leaf
        return qwen3.get(leaf, (c,))
    shapes = {
        "patch_embed": (c, 3, v.patch_size, v.patch_size), "patch_embed_bias": (c,),
        "pos_embed": (v.patches_per_side ** 2, c), "qkv": (3 * c, c), "qkv_bias": (3 * c,),
        "o": (c, c), "fc1": (inter, c), "fc1_bias": (inter,), "fc2": (c, inter),
        "proj": (v.out_hidden, c * (v.scale_factor ** 2 if v.connector == "pixel_shuffle" else 1)),
    }
    return shapes.get(leaf, (c,))  # the norms and the remaining biases


def siglip_weights(tower: str) -> dict[str, str | tuple[str, ...]]:
    """The canonical names of a SigLIP tower (the "siglip" layout above, projector not included) -> the checkpoint
    keys under ``tower`` ("model.vision_model." for Idefics3 / SmolVLM, "model.vision_tower." for Gemma 3)."""
    layer = tower + "encoder.layers.{i}."
    return {
        "vision.patch_embed": tower + "embeddings.patch_embedding.weight",
        "vision.patch_embed_bias": tower + "embeddings.patch_embedding.bias",
        "vision.pos_embed": tower + "embeddings.position_embedding.weight",
        "vision.layers.{i}.ln1": layer + "layer_norm1.weight",
        "vision.layers.{i}.ln1_bias": layer + "layer_norm1.bias",
        "vision.layers.{i}.qkv": tuple(layer + f"self_attn.{x}_proj.weight" for x in "qkv"),
        "vision.layers.{i}.qkv_bias": tuple(layer + f"self_attn.{x}_proj.bias" for x in "qkv"),
        "vision.layers.{i}.o": layer + "self_attn.out_proj.weight",
        "vision.layers.{i}.o_bias": layer + "self_attn.out_proj.bias",
        "vision.layers.{i}.ln2": layer + "layer_norm2.weight",
        "vision.layers.{i}.ln2_bias": layer + "layer_norm2.bias",
        "vision.layers.{i}.fc1": layer + "mlp.fc1.weight",
        "vision.layers.{i}.fc1_bias": layer + "mlp.fc1.bias",
        "vision.layers.{i}.fc2": layer + "mlp.fc2.weight",
        "vision.layers.{i}.fc2_bias": layer + "mlp.fc2.bias",
        "vision.post_ln": tower + "post_layernorm.weight",
        "vision.post_ln_bias": tower + "post_layernorm.bias",
    }
