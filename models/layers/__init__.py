"""The layer kinds a model is built from: one frozen, typed spec per kind, each in its own module.

A layer is a token mixer and an MLP (``LayerSpec``), either of which may be absent:

    mixers   AttentionSpec ("attention")      K/V cache                       models/layers/attention.py
             ShortConvSpec ("conv")           a conv state                    models/layers/short_conv.py
             GatedDeltaNetSpec ("linear_attention")  conv + recurrent state   models/layers/delta_net.py
             Mamba2Spec ("mamba2")            conv + recurrent state          models/layers/mamba2.py
    MLPs     DenseMLPSpec ("dense")                                           models/layers/mlp.py
             MoESpec ("moe")                                                  models/layers/moe.py

Each kind spec declares its settings, the leaf names and shapes of its weights (``leaves``, ``shapes``), the
checkpoint parts fused into one weight (``fused_rows``) and the per-slot states it keeps (``states``); its
lowering is export/lowering/<kind>.py, found through export/lowering/layers/__init__.py's table. A new kind is a module
here, its entry in ``MIXERS`` or ``MLPS`` and its lowering; a family that reuses kinds touches none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

from decodert.models.layers.attention import ROPE_TABLES, AttentionSpec
from decodert.models.layers.delta_net import GatedDeltaNetSpec
from decodert.models.layers.mamba2 import Mamba2Spec
from decodert.models.layers.mlp import ACTIVATIONS, DenseMLPSpec
from decodert.models.layers.moe import MoESpec
from decodert.models.layers.short_conv import ShortConvSpec

MixerSpec = Union[AttentionSpec, ShortConvSpec, GatedDeltaNetSpec, Mamba2Spec]
MLPSpec = Union[DenseMLPSpec, MoESpec]
# kind name -> spec class; the names are the manifest's (kv.layer_kinds, the spec's "kind" keys)
MIXERS: dict[str, type] = {c.kind: c for c in (AttentionSpec, ShortConvSpec, GatedDeltaNetSpec, Mamba2Spec)}
MLPS: dict[str, type] = {c.kind: c for c in (DenseMLPSpec, MoESpec)}
NO_MIXER = NO_MLP = "none"  # a layer that is its MLP alone (Nemotron-H's MLP blocks), or its mixer alone

__all__ = ["ACTIVATIONS", "MIXERS", "MLPS", "NO_MIXER", "NO_MLP", "ROPE_TABLES", "AttentionSpec", "DenseMLPSpec",
           "GatedDeltaNetSpec", "LayerSpec", "Mamba2Spec", "MixerSpec", "MLPSpec", "MoESpec", "ShortConvSpec",
           "kind_from_dict", "kind_to_dict", "layers_from_dict", "layers_to_dict"]


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: input_norm + mixer (None: no mixer), then post_norm + MLP (None: no MLP)."""

    mixer: MixerSpec | None
    mlp: MLPSpec | None

    def __post_init__(self) -> None:
        if self.mixer is None and self.mlp is None:
            raise ValueError("a layer needs a mixer or an MLP (layer kind 'none' with mlp type 'none')")

    @property
    def mixer_kind(self) -> str:
        return self.mixer.kind if self.mixer is not None else NO_MIXER

    @property
    def mlp_kind(self) -> str:
        return self.mlp.kind if self.mlp is not None else NO_MLP


def layers_to_dict(layers: tuple[LayerSpec, ...]) -> dict[str, Any]:
    """The layers as JSON values: the distinct mixer and MLP specs (``mixers``, ``mlps``) and, per layer, their
    indices (``layers``: {"mixer": i | None, "mlp": j | None})."""
    mixers: list[Any] = []
    mlps: list[Any] = []

    def index(table: list[Any], spec: Any) -> int | None:
        if spec is None:
            return None
        if spec not in table:
            table.append(spec)
        return table.index(spec)

    per_layer = [{"mixer": index(mixers, layer.mixer), "mlp": index(mlps, layer.mlp)} for layer in layers]
    return {"mixers": [kind_to_dict(m) for m in mixers], "mlps": [kind_to_dict(m) for m in mlps], "layers": per_layer}


def layers_from_dict(d: dict[str, Any]) -> tuple[LayerSpec, ...]:
    """The inverse of layers_to_dict (``d`` holds ``mixers``, ``mlps`` and ``layers``)."""
    mixers = [kind_from_dict(m, MIXERS) for m in d["mixers"]]
    mlps = [kind_from_dict(m, MLPS) for m in d["mlps"]]
    return tuple(LayerSpec(None if layer["mixer"] is None else mixers[layer["mixer"]],
                           None if layer["mlp"] is None else mlps[layer["mlp"]]) for layer in d["layers"])


def kind_to_dict(spec: Any) -> dict[str, Any]:
    """A kind spec as JSON values: ``kind`` first, then its fields (a nested kind spec as its own dict)."""
    out: dict[str, Any] = {"kind": spec.kind}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        out[f.name] = kind_to_dict(value) if hasattr(value, "kind") and dataclasses.is_dataclass(value) else \
            list(value) if isinstance(value, tuple) else value
    return out


def kind_from_dict(d: dict[str, Any], table: dict[str, type]) -> Any:
    """The inverse of kind_to_dict over ``table`` (MIXERS or MLPS); a nested dict with a ``kind`` is an MLP
    (MoESpec.shared). ValueError names an unknown kind or field."""
    cls = table.get(d.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"layer kind '{d.get('kind')}' is not one of {', '.join(table)}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known - {"kind"})
    if unknown:
        raise ValueError(f"'{unknown[0]}' is not a setting of a '{cls.kind}' layer")
    fields = {k: kind_from_dict(v, MLPS) if isinstance(v, dict) and "kind" in v else v for k, v in d.items() if k != "kind"}
    return cls(**fields)
