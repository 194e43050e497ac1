"""LoRA in decodert's canonical weights, and the slots an artifact's graphs take adapters in.

A PEFT adapter adapts checkpoint modules (q_proj, k_proj, ...); decodert's graphs fuse q/k/v into
``qkv`` and gate/up into ``gate_up`` (models/spec.py ``canonical_names``). So an adapter is kept per
canonical *target* and its *parts*, the row blocks of that target's output:

    target    parts            part rows                   PEFT modules (PEFT_MODULES)
    qkv       q, k, v          H*D, Hkv*D, Hkv*D           q_proj, k_proj, v_proj (or a fused qkv_proj)
    o         o                hidden                      o_proj
    gate_up   gate, up         I, I                        gate_proj, up_proj (or a fused gate_up_proj)
    down      down             hidden                      down_proj

Part p of layer i adds ``scale * (x @ A^T) @ B^T`` to its rows: A [r, in], B [rows_p, r].

Export with ``--lora-slots N --lora-rank R`` gives every graph these runtime inputs (dtype = the
artifact's), so adapters load and unload without a re-export and rows of one batch use different ones:

    lora_index            [batch] int64         per row: 0 (or any value outside 1..N) = no adapter, k = slot k
    lora_a.{i}.{target}   [P*N*R, in]           rows (part, slot, rank): A of every part and slot
    lora_b.{i}.{part}     [rows_p, N*R]         columns (slot, rank): scale * B of that part and slot

An adapter of rank r < R fills the first r rows/columns of its slot and leaves the rest zero. The graph
(export/lowering/lora_graph.py) computes ``t = x @ lora_a^T`` [T, P*N*R] once per target, zeroes the
columns of every slot but each row's own (a mask from lora_index), and adds ``t_p @ lora_b.{i}.{part}^T`` to
each part's rows: every row reads the same stacked weights, nothing is gathered or copied per step. Both
are stored as PEFT stores them ([out, in]), like the base weights, so loading an adapter copies rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decodert.artifact.records import Record
from decodert.errors import DecodertError
from decodert.models.spec import ModelSpec
from decodert.models.canonical import canonical_shape

TARGET_PARTS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"),
                                           "down": ("down",)}
# PEFT module name -> (canonical target, the parts of it the module's output rows cover)
PEFT_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "q_proj": ("qkv", ("q",)), "k_proj": ("qkv", ("k",)), "v_proj": ("qkv", ("v",)), "qkv_proj": ("qkv", ("q", "k", "v")),
    "o_proj": ("o", ("o",)),
    "gate_proj": ("gate_up", ("gate",)), "up_proj": ("gate_up", ("up",)), "gate_up_proj": ("gate_up", ("gate", "up")),
    "down_proj": ("down", ("down",)),
}


def part_rows(spec: ModelSpec, target: str) -> dict[str, int]:
    """Output rows of each part of ``target``, in row order."""
    n = spec.num_layers
    if (not spec.uniform_head_dim or len({spec.mlp_size(i) for i in range(n) if spec.has_mlp(i)}) > 1
            or any(spec.kv_source(i) != i for i in range(n))):
        raise DecodertError(f"LoRA adapters are not supported for {spec.family}: its layers differ in shape "
                            "(per-layer head dims, MLP widths or shared K/V)")
    q, kv, inter, h = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.mlp_size(0), spec.hidden_size
    rows = {"qkv": (q, kv, kv), "o": (h,), "gate_up": (inter, inter), "down": (h,)}[target]
    return dict(zip(TARGET_PARTS[target], rows))


def in_features(spec: ModelSpec, target: str) -> int:
    return canonical_shape(spec, f"layers.0.{target}")[1]


@dataclass
class LoraAdapter:
    """One adapter in canonical form: ``parts[(layer, part)] = (A [r, in], B [rows, r] with the scale folded in)``, float32."""

    name: str  # where it came from (for messages)
    parts: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.parts.values()), default=0)

    def delta(self, spec: ModelSpec, layer: int, target: str) -> np.ndarray | None:
        """The merged update of canonical weight ``layers.{layer}.{target}`` [out, in] (None: not adapted)."""
        blocks, any_part = [], False
        for part, rows in part_rows(spec, target).items():
            ab = self.parts.get((layer, part))
            any_part |= ab is not None
            blocks.append(np.zeros((rows, in_features(spec, target)), np.float32) if ab is None
                          else (ab[1].astype(np.float64) @ ab[0].astype(np.float64)).astype(np.float32))
        return np.concatenate(blocks, axis=0) if any_part else None


@dataclass(frozen=True)
class LoraLayout:
    """The adapter slots of an artifact (``--lora-slots``, ``--lora-rank``): the graphs' extra inputs."""

    slots: int
    rank: int

    def inputs(self, spec: ModelSpec, dtype: str) -> list[dict]:
        """Name, dtype and shape of every LoRA input, in graph input order (``lora_index`` first)."""
        n, r = self.slots, self.rank
        out: list[dict[str, Any]] = [{"name": "lora_index", "dtype": "int64", "shape": ["batch"]}]
        for i in range(spec.num_layers):
            for target, parts in TARGET_PARTS.items():
                out.append({"name": f"lora_a.{i}.{target}", "dtype": dtype,
                            "shape": [len(parts) * n * r, in_features(spec, target)]})
                for part, rows in part_rows(spec, target).items():
                    out.append({"name": f"lora_b.{i}.{part}", "dtype": dtype, "shape": [rows, n * r]})
        return out

    def allocate(self, spec: ModelSpec, np_dtype: type) -> dict[str, np.ndarray]:
        """Zeroed weight inputs (every slot empty), by input name."""
        return {io["name"]: np.zeros(io["shape"], np_dtype) for io in self.inputs(spec, "-")[1:]}

    def write(self, arrays: dict[str, np.ndarray], spec: ModelSpec, slot: int, adapter: LoraAdapter | None) -> None:
        """Put ``adapter`` into slot ``slot`` (1..slots) of ``arrays``; None empties the slot."""
        n, r = self.slots, self.rank
        k = slot - 1
        for i in range(spec.num_layers):
            for target, parts in TARGET_PARTS.items():
                a_all = arrays[f"lora_a.{i}.{target}"]  # [P*N*R, in]
                for p, part in enumerate(parts):
                    start = (p * n + k) * r
                    b_all = arrays[f"lora_b.{i}.{part}"]  # [rows, N*R]
                    a_all[start : start + r] = 0
                    b_all[:, k * r : (k + 1) * r] = 0
                    ab = adapter.parts.get((i, part)) if adapter is not None else None
                    if ab is not None:
                        a, b = ab  # [rank, in], [rows, rank]
                        a_all[start : start + a.shape[0]] = a
                        b_all[:, k * r : k * r + a.shape[0]] = b


@dataclass(frozen=True)
class LoraRecord(Record):
    """LoRA adapters: the slots the graphs take at run time (``--lora-slots/--lora-rank``; this module)
    and the adapters merged into the weights (``--merge-lora``)."""
    slots: int = 0  # 0: the graphs take no adapters
    rank: int = 0
    merged: tuple[str, ...] = ()  # adapter folders folded into weights.bin

    @property
    def layout(self) -> LoraLayout | None:
        return LoraLayout(self.slots, self.rank) if self.slots else None
