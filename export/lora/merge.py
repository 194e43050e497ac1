"""``decodert export --merge-lora DIR``: a checkpoint whose linear weights carry the adapters' updates.

``MergedCheckpoint`` wraps the checkpoint the export reads: ``tensor("layers.i.qkv")`` is the base weight
plus ``B @ A`` (scaled) of every part an adapter adapts, summed in float64 and returned as float32; the rest
passes through. A merged weight is never transcoded from GGUF blocks, nor copied from a GPTQ / AWQ
checkpoint's packed blocks (it is no longer what the blocks hold): a quantized export rounds it to nearest
like any float weight.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from decodert.artifact.lora_layout import LoraAdapter

_LAYER = re.compile(r"^layers\.(\d+)\.(qkv|o|gate_up|down)$")


class MergedCheckpoint:
    """``ckpt`` with ``adapters`` merged into its weights (everything else delegated)."""

    def __init__(self, ckpt: Any, adapters: list[LoraAdapter]) -> None:
        self._ckpt, self._adapters = ckpt, adapters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ckpt, name)

    def _deltas(self, name: str) -> list[np.ndarray]:
        m = _LAYER.match(name)
        if m is None:
            return []
        deltas = [a.delta(self._ckpt.spec, int(m[1]), m[2]) for a in self._adapters]
        return [d for d in deltas if d is not None]

    def block_type(self, name: str) -> str | None:
        return None if self._deltas(name) else self._ckpt.block_type(name)

    def packed(self, name: str) -> Any:
        return None if self._deltas(name) else self._ckpt.packed(name)

    def tensor(self, name: str) -> np.ndarray:
        w = self._ckpt.tensor(name)
        deltas = self._deltas(name)
        if not deltas:
            return w
        return (w.astype(np.float64) + sum(d.astype(np.float64) for d in deltas)).astype(np.float32)
