"""The LoRA adapters one LLM serves: a name -> a slot of the artifact's stacked adapter inputs.

An artifact exported with ``--lora-slots N --lora-rank R`` takes N adapters at run time
(artifact/lora_layout.py); the backend owns the input arrays (bound once) and this table writes adapters
into them and takes them out, without a re-export. Each load gets a fresh ``tag``: a row's K/V and the
prefix cache's blocks are keyed by it (runtime/backends/kv_cache.py ``use_adapter``), so K/V computed
under an adapter that was unloaded, or replaced in its slot, are never read again.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.lora_layout import LoraLayout
from decodert.artifact.peft import CONFIG, WEIGHTS, read_peft
from decodert.models.spec import ModelSpec

_TAGS = itertools.count(1)  # load tags, unique in the process (0 = no adapter)


@dataclass(frozen=True)
class Loaded:
    slot: int  # 1..N: the row value of lora_index
    tag: int  # unique per load
    source: str  # the folder it was read from
    rank: int
    key: str = ""  # stable across processes: blake2b of the folder's weights and config (the disk tier's adapter key)


class Adapters:
    """``name -> Loaded`` over a backend's LoRA input arrays (``backend.lora_weights``)."""

    def __init__(self, layout: LoraLayout | None, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None) -> None:
        self.layout, self.spec, self.weights = layout, spec, weights
        self._loaded: dict[str, Loaded] = {}

    @property
    def names(self) -> list[str]:
        return list(self._loaded)

    def info(self, name: str) -> Loaded:
        return self._loaded[name]

    def load(self, name: str, folder: str | Path) -> Loaded:
        """Read the PEFT folder and put it into a free slot (replacing an adapter of the same name)."""
        if not isinstance(name, str) or not name or ":" in name or name != name.strip():
            raise DecodertError(f"adapter name {name!r} must be a non-empty string without ':' or surrounding spaces")
        if self.layout is None or self.weights is None or self.spec is None:
            raise DecodertError(f"adapter {name!r}: this artifact takes no LoRA adapters at run time; export it with "
                                "--lora-slots N --lora-rank R (ort or portable target), or merge one with --merge-lora")
        adapter = read_peft(folder, self.spec, name)
        if adapter.rank > self.layout.rank:
            raise DecodertError(f"adapter {name!r} ({folder}) has rank {adapter.rank}, above the artifact's "
                                f"--lora-rank {self.layout.rank}; re-export with --lora-rank {adapter.rank} or more")
        old = self._loaded.pop(name, None)
        used = {a.slot for a in self._loaded.values()}
        slot = old.slot if old is not None else next((k for k in range(1, self.layout.slots + 1) if k not in used), None)
        if slot is None:
            raise DecodertError(f"adapter {name!r}: all {self.layout.slots} LoRA slots are taken "
                                f"({', '.join(self._loaded)}); unload one, or export with more --lora-slots")
        self.layout.write(self.weights, self.spec, slot, adapter)
        self._loaded[name] = Loaded(slot, next(_TAGS), str(folder), adapter.rank, _content_key(Path(folder)))
        return self._loaded[name]

    def key_of(self, tag: int) -> str | None:
        """The stable key of the adapter loaded as ``tag`` ("" for 0, the base model; None: not loaded now)."""
        if tag == 0:
            return ""
        return next((a.key for a in self._loaded.values() if a.tag == tag and a.key), None)

    def unload(self, name: str) -> None:
        loaded = self._loaded.pop(self._known(name), None)
        if loaded is not None and self.layout is not None and self.weights is not None and self.spec is not None:
            self.layout.write(self.weights, self.spec, loaded.slot, None)

    def resolve(self, name: Any) -> tuple[int, int]:
        """``adapter=`` of a request -> (slot index, load tag); None or "" -> (0, 0), the base model."""
        if name is None or name == "":
            return 0, 0
        loaded = self._loaded[self._known(name)]
        return loaded.slot, loaded.tag

    def _known(self, name: Any) -> str:
        if not isinstance(name, str) or name not in self._loaded:
            have = ", ".join(repr(n) for n in self._loaded) or "none"
            raise DecodertError(f"unknown adapter {name!r}; loaded: {have}")
        return name


def _content_key(folder: Path) -> str:
    """blake2b (16 hex) of an adapter folder's weights and config bytes ("" when they cannot be read)."""
    h = hashlib.blake2b(digest_size=8)
    try:
        for name in (CONFIG, WEIGHTS):
            with open(folder / name, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                h.update(b"\0" + name.encode())
    except OSError:
        return ""
    return h.hexdigest()
