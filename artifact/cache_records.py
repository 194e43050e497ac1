"""The manifest's cache records: the K/V geometry and, for hybrid models, each layer's kind and states
(docs/features/cache-state.md); artifact/manifest.py reads and checks them."""

from __future__ import annotations

import dataclasses
import math

from decodert.artifact.records import Record
from decodert.artifact.weights import NUMPY_DTYPES


@dataclasses.dataclass(frozen=True)
class StateRecord(Record):
    """A per-slot state of a non-attention layer: graph I/O past_{name}.{layer} / present_{name}.{layer}."""
    layer: int
    name: str  # "conv" | "recurrent"
    shape: tuple[int | str, ...]  # ["batch", ...per-slot dims]
    dtype: str | None = None  # None: the manifest's dtype; "fp32": a recurrent state kept in float32

    @property
    def io_name(self) -> str:
        return f"{self.name}.{self.layer}"

    def itemsize(self, model_itemsize: int) -> int:
        return 4 if self.dtype == "fp32" else model_itemsize


@dataclasses.dataclass(frozen=True)
class KVRecord(Record):
    num_layers: int  # layers that keep K/V (attention layers; every layer unless layer_kinds says otherwise)
    num_kv_heads: int
    head_dim: int
    dtype: str | None = None  # the cache tensors' element type (None: the manifest's dtype; plugins/ops/kv_dtypes.py)
    shape: tuple[int | str, ...] = ()  # [batch, num_kv_heads, max_seq, width] (width: head_dim, or head_dim/2 at int4)
    inplace: bool = True  # present_* alias past_* (the graphs write the cache in place)
    scales: str | None = None  # a quantized cache: "per_channel" (kv_scale.* initializers in the graphs)
    layer_kinds: tuple[str, ...] = ()  # per model layer (models/spec.py LAYER_KINDS); () = all attention
    states: tuple[StateRecord, ...] = ()  # the other layers' states, in graph I/O order
    head_dims: tuple[int, ...] = ()  # per K/V layer, its head_dim (Gemma 4: the full layers' is larger); () = head_dim

    @property
    def dims(self) -> tuple[int, ...]:
        """The head_dim of each K/V pair's cache, in order."""
        return self.head_dims or (self.head_dim,) * self.num_layers

    @property
    def layers(self) -> tuple[int, ...]:
        """The model layer of each K/V pair (past_key.{i})."""
        if not self.layer_kinds:
            return tuple(range(self.num_layers))
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "attention")

    def cache_layout(self, model_dtype: str) -> dict:
        """KVCache's keyword arguments beyond the K/V geometry: kv_layers and states (io name, per-slot shape,
        numpy dtype: the state's own, else the model's ``model_dtype``, never the K/V cache's, which a
        ``--kv-dtype`` may make int8 / int4 codes)."""
        return {"kv_layers": self.layers,
                "states": [(st.io_name, tuple(int(d) for d in st.shape[1:]), NUMPY_DTYPES[st.dtype or model_dtype])
                           for st in self.states]}

    def state_bytes(self, slots: int, itemsize: int) -> int:
        """Bytes of every state of ``slots`` rows (``itemsize``: the model dtype's)."""
        return sum(slots * st.itemsize(itemsize) * math.prod(int(d) for d in st.shape[1:]) for st in self.states)
