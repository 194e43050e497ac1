"""Open a checkpoint (Hugging Face folder or GGUF file) and serve canonical float32 tensors.

    ckpt = open_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
    for name in ckpt.names():
        w = ckpt.tensor(name)          # np.float32, canonical_shape(ckpt.spec, name)
        ...                            # drop w before asking for the next one
    info = ckpt.write_tokenizer(out_dir)

Family files declare where each canonical weight comes from (``HF_WEIGHTS`` / ``GGUF_WEIGHTS``);
this module resolves ``{i}``, validates shapes before reading, fuses parts on axis 0 and applies
the family's quirk hook (``gguf_fix``) on GGUF tensors.

GGUF weights stored in Q4_0 / Q8_0 blocks can also be read without dequantizing them:
``ckpt.block_type(name)`` names the type and ``ckpt.blocks(name)`` transcodes the blocks into
export/quantize/quant.py's layout exactly (fused parts concatenated, a quirk that reorders rows applied
to the quantized rows).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from decodert.errors import DecodertError, first_line
from decodert.export.lowering.semantics import check_finite, check_spec
from decodert.models.family import Family
from decodert.models.layers import MoESpec
from decodert.models.spec import ModelSpec
from decodert.models.canonical import canonical_names, canonical_shape, fused_rows

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# What a family's spec_from_* raises on a value of the wrong type or range (metadata is untrusted).
_BAD_VALUE = (TypeError, ValueError, OverflowError, ZeroDivisionError, KeyError, IndexError, AttributeError)
_POSITIVE = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position")


def one_line(e: BaseException) -> str:
    """``TypeName: first line of the message`` for wrapping third-party errors into DecodertError."""
    return f"{type(e).__name__}: {first_line(e)}"


def build_spec(make: Callable[[], ModelSpec], where: Path | str, n_tensors: int) -> ModelSpec:
    """Run a family's ``spec_from_*`` on untrusted settings; every failure is a DecodertError naming ``where``.

    The spec is also checked against the file: sizes positive, the RoPE head dim even, and no more
    layers than the checkpoint has tensors (a huge declared layer count must not make a huge name list).
    """
    try:
        spec = make()
        sizes = [(name, getattr(spec, name)) for name in _POSITIVE]
        sizes += [("intermediate_size", m.size) for m in {spec.dense_mlp(i) for i in range(spec.num_layers)} - {None}]
        for name, value in sizes:
            if not isinstance(value, int) or value < 1:
                raise DecodertError(f"{name} {value!r} must be a positive integer")
    except DecodertError as e:
        raise DecodertError(f"{where}: {e}") from None
    except _BAD_VALUE as e:
        raise DecodertError(f"{where}: invalid model settings ({one_line(e)})") from None
    check_spec(spec, where)  # finite, positive float settings (RoPE base, RMS epsilon)
    rot = spec.rope.rotary_dim or spec.head_dim
    if spec.head_dim % 2 or rot % 2 or not 2 <= rot <= spec.head_dim:
        raise DecodertError(f"{where}: head_dim {spec.head_dim} and rotary dim {rot} must be even, rotary <= head_dim")
    if spec.num_layers > n_tensors:
        raise DecodertError(f"{where}: declares {spec.num_layers} layers but holds only {n_tensors} tensors")
    return spec


def source_keys(table: dict[str, str | tuple[str, ...]], name: str) -> tuple[str, ...]:
    """Checkpoint keys for one canonical name: 'layers.3.qkv' -> ('...3...q', '...3...k', '...3...v')."""
    m = _LAYER.match(name)
    template, index = (f"layers.{{i}}.{m.group(2)}", m.group(1)) if m else (name, None)
    if template not in table:
        raise KeyError(f"no source for canonical weight '{name}'")
    keys = table[template]
    keys = (keys,) if isinstance(keys, str) else keys
    return tuple(k.format(i=index, j="{j}") for k in keys)  # {j}: the expert, filled by expert_keys


def expert_keys(keys: tuple[str, ...], j: int) -> tuple[str, ...]:
    """The checkpoint keys of expert ``j`` (a key ending in ``[j]`` is row j of a stacked [E, ...] tensor)."""
    return tuple(k.format(j=j) for k in keys)


_STACKED = re.compile(r"^(.+)\[(\d+)\]$")
_TRANSPOSED = ".T"  # a table key ending so names a matrix stored [in, out] (gpt-oss experts): read transposed


def is_experts(name: str) -> bool:
    """Is canonical weight ``name`` a stack of per-expert matrices [E, rows, in] (read one expert at a time)?"""
    return ".experts." in name


def num_experts(spec: ModelSpec, name: str) -> int:
    """The experts of canonical weight ``name``'s layer (of the model's first MoE layer for any other name; 0: none)."""
    parts = name.split(".")
    mlp = spec.mlp(int(parts[1])) if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit() else None
    moe = mlp if isinstance(mlp, MoESpec) else spec.experts()
    return moe.num_experts if moe is not None else 0


def part_shapes(spec: ModelSpec, name: str, n_parts: int) -> list[tuple[int, ...]]:
    """Expected shape of each checkpoint part that is concatenated (axis 0) into `name`."""
    full = canonical_shape(spec, name)
    if is_experts(name):  # one expert's parts: gate and up rows (interleaved when fused)
        full = full[1:]
        return [(full[0] // n_parts, *full[1:])] * n_parts
    if n_parts == 1:
        return [full]
    rest = full[1:]
    rows = fused_rows(spec, name)
    if rows is not None and len(rows) == n_parts:
        return [(r, *rest) for r in rows]
    if full[0] % n_parts:
        raise ValueError(f"cannot split {name} {full} into {n_parts} parts")
    return [(full[0] // n_parts, *rest)] * n_parts


class Checkpoint:
    """Base class: subclasses provide `_shape(key)`, `_read(key)` and `write_tokenizer(out_dir)`."""

    kind: str = "?"  # "hf" | "gguf"

    def __init__(self, source: Path, spec: ModelSpec, family: Family, table: dict) -> None:
        """``spec`` must come from ``build_spec`` (checked against the file)."""
        self.source = source
        self.spec = spec
        self.family = family
        self.table = table
        self._names = canonical_names(spec)

    # -- subclass hooks --------------------------------------------------------------------------
    def _shape(self, key: str) -> tuple[int, ...]:
        """Shape of a checkpoint tensor in canonical orientation; DecodertError when missing."""
        raise NotImplementedError

    def _read(self, key: str) -> np.ndarray:
        """The tensor as float32 in canonical orientation (no family quirks applied)."""
        raise NotImplementedError

    def _check_key(self, key: str) -> object:
        """Extra per-tensor check before reading (GGUF: quantisation type); raise DecodertError."""
        return None

    def _fix(self, key: str, w: np.ndarray) -> np.ndarray:
        return w

    def write_tokenizer(self, out_dir: str | Path) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # -- public ----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Canonical weight names, in weights.bin order."""
        return list(self._names)

    def _part_shape(self, key: str) -> tuple[int, ...]:
        """``_shape``, where ``key[j]`` is one row of a stacked tensor and ``key.T`` a matrix stored [in, out]."""
        if key.endswith(_TRANSPOSED):
            return tuple(reversed(self._part_shape(key[: -len(_TRANSPOSED)])))
        m = _STACKED.match(key)
        if m is None:
            return self._shape(key)
        shape = self._shape(m.group(1))
        if len(shape) < 2 or int(m.group(2)) >= shape[0]:
            raise DecodertError(f"{self.source}: tensor '{m.group(1)}' {list(shape)} has no expert {m.group(2)}; "
                                f"the config declares {num_experts(self.spec, key)} experts")
        return shape[1:]

    def _read_part(self, key: str) -> np.ndarray:
        if key.endswith(_TRANSPOSED):
            return np.ascontiguousarray(self._read_part(key[: -len(_TRANSPOSED)]).T)
        m = _STACKED.match(key)
        return self._read(key) if m is None else self._read_row(m.group(1), int(m.group(2)))

    def _read_row(self, key: str, row: int) -> np.ndarray:
        """Row ``row`` of stacked tensor ``key`` as float32 (subclasses may avoid reading the rest)."""
        return self._read(key)[row]

    def _all_keys(self, name: str) -> tuple[str, ...]:
        keys = source_keys(self.table, name)
        if not is_experts(name):
            return keys
        return tuple(k for j in range(num_experts(self.spec, name)) for k in expert_keys(keys, j))

    def _parts(self, name: str) -> tuple[str, ...]:
        """Checkpoint keys of `name` (every expert's, for experts), after checking each exists with the expected shape."""
        keys = self._all_keys(name)
        expected_shapes = part_shapes(self.spec, name, len(source_keys(self.table, name)))
        for n, key in enumerate(keys):
            expected = expected_shapes[n % len(expected_shapes)]
            shape = self._part_shape(key)
            if shape != expected:
                raise DecodertError(
                    f"{self.source}: tensor '{key}' has shape {list(shape)}, expected {list(expected)} for '{name}'"
                )
            self._check_key(_STACKED.sub(r"\1", key.removesuffix(_TRANSPOSED)))
        return keys

    def validate(self) -> None:
        """Check every canonical weight is present, well-shaped and readable, without reading data."""
        for name in self.names():
            self._parts(name)

    def used_keys(self) -> set[str]:
        """The checkpoint keys the canonical weights are read from."""
        return {_STACKED.sub(r"\1", key.removesuffix(_TRANSPOSED)) for name in self.names() for key in self._all_keys(name)}

    def block_type(self, name: str) -> str | None:
        """The block quantization type (GGUF's name, e.g. "Q4_0") every part of `name` is stored in,
        or None: a float checkpoint, parts of different types, or a quirk that is not a row reorder."""
        return None

    def blocks(self, name: str) -> Any:
        """`name` transcoded from its stored blocks (export/quantize/quant_gguf.py); only when block_type(name) is set."""
        raise NotImplementedError(f"{name} is not stored in blocks decodert transcodes")

    def native_quant(self) -> Any:
        """The QuantConfig that keeps the checkpoint's own quantized weights (GPTQ / AWQ), or None."""
        return None

    def packed(self, name: str) -> Any:
        """(QuantizedWeight, WeightQuant) of a GPTQ / AWQ weight, transcoded exactly; None for others."""
        return None

    def tensor(self, name: str) -> np.ndarray:
        """Canonical weight `name` as a fresh float32 array of canonical_shape(spec, name).

        Experts are stacked here [E, rows, in]; an export reads them one at a time (``expert``)."""
        if name not in self._names:
            raise KeyError(f"'{name}' is not a canonical weight of this {self.spec.family} model")
        if is_experts(name):
            return np.stack([self.expert(name, j) for j in range(num_experts(self.spec, name))])
        return self._fused(self._parts(name), interleave=False)

    def rows(self, name: str) -> Iterator[np.ndarray]:
        """Canonical weight ``name`` one float32 row at a time: a large table (Gemma 4's per-layer embeddings,
        2.35 B values in E2B) written without ever holding it whole in float32. One plain checkpoint tensor only."""
        keys = source_keys(self.table, name)
        if len(keys) != 1 or keys[0].endswith(_TRANSPOSED) or _STACKED.match(keys[0]) or is_experts(name):
            raise ValueError(f"'{name}' is not one plain checkpoint tensor: read it with tensor()")
        key = keys[0]
        for j in range(self._part_shape(key)[0]):
            row = self._fix(key, self._read_row(key, j))
            check_finite([row], key, self.source)
            yield row

    def expert(self, name: str, j: int) -> np.ndarray:
        """Expert ``j`` of canonical experts weight ``name`` as float32 [rows, in]; fused gate/up rows interleaved."""
        if name not in self._names or not is_experts(name):
            raise KeyError(f"'{name}' is not an experts weight of this {self.spec.family} model")
        return self._fused(expert_keys(source_keys(self.table, name), j), interleave=True)

    def _fused(self, keys: tuple[str, ...], interleave: bool) -> np.ndarray:
        parts = [self._fix(key, self._read_part(key)) for key in keys]
        for key, part in zip(keys, parts):
            check_finite([part], key, self.source)
        if len(parts) == 1:
            w = parts[0]
        elif interleave:  # an expert's gate and up rows: gate 0, up 0, gate 1, up 1, ... (what ORT's MoE reads)
            w = np.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])
        else:  # fused rows: q|k|v, gate|up
            w = np.concatenate(parts, axis=0)
        return np.ascontiguousarray(w, dtype=np.float32)

    def vision_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Canonical vision weight ``name`` (models/vision.py) of ``shape``, from the family's ``VISION_WEIGHTS``
        (parts concatenated along axis 0: q|k|v), as a fresh float32 array."""
        return self._side_tensor(self.family.vision_weights, name, shape, self.family.vision_fix)

    def audio_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Canonical audio weight ``name`` (models/audio.py) of ``shape``, from the family's ``AUDIO_WEIGHTS``."""
        return self._side_tensor(self.family.audio_weights, name, shape, self.family.audio_fix)

    def _side_tensor(self, table: Any, name: str, shape: tuple[int, ...], fix: Any) -> np.ndarray:
        template = re.sub(r"\.layers\.(\d+)\.", ".layers.{i}.", name)
        index = m.group(1) if (m := re.search(r"\.layers\.(\d+)\.", name)) else None
        keys = table[template]
        keys = tuple(k.format(i=index) for k in ((keys,) if isinstance(keys, str) else keys))
        parts = [self._read(key) for key in keys]  # (scalars joined as [n]: a clipped linear's four bounds)
        w = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate([np.atleast_1d(p) for p in parts]),
                                 dtype=np.float32)
        w = np.ascontiguousarray(fix(name, w), dtype=np.float32) if fix is not None else w
        check_finite([w], keys[0], self.source)  # after the fix: one may map a stored infinity to a finite bound
        if len(shape) == 2 and w.ndim > 2 and w.shape[0] == shape[0] and w.size == math.prod(shape):
            w = w.reshape(shape)  # a conv kernel [C, ...window] read as a linear over its flattened window
        if w.shape != shape:
            raise DecodertError(f"{self.source}: tensor '{keys[0]}' has shape {list(w.shape)}, expected {list(shape)} "
                                f"for '{name}'")
        return w

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec.family} {self.source}>"
