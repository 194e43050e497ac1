"""A minimal lazy safetensors reader: header validated up front, tensors read through mmap. Export reads HF
checkpoints with it (export/checkpoints/checkpoint_hf.py), the runtime PEFT adapter folders (artifact/peft.py).

Own reader instead of ``safetensors.safe_open`` so that bf16 works without torch or ml_dtypes and
every size in the header is checked against the file before anything is read.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError

# I32: GPTQ / AWQ packed words and g_idx; U8: MXFP4 blocks and scales (gpt-oss experts); I64: index tables
# (Gemma 4 assistant's token_ordering, EAGLE-3's d2t, read with raw); BOOL: EAGLE-3's t2d
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32,
           "U8": np.uint8, "I64": np.int64, "BOOL": np.bool_}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (bf16 is the top half of an fp32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _int_list(value: Any) -> bool:
    """A list of non-negative ints (bools, floats and huge JSON numbers as strings are not)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


class SafetensorsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise DecodertError(f"{path}: cannot open ({e.strerror})") from None
        try:
            size = path.stat().st_size
            self._base, header = self._read_header(size)
            self._entries = {k: self._check(k, v, size - self._base) for k, v in header.items()}
            if size > self._base:
                self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise

    def _read_header(self, size: int) -> tuple[int, dict]:
        """(offset of the data section, {key: entry}) from the 8-byte length + JSON header."""
        head = self._file.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if 8 + n > size:
            raise DecodertError(f"{self.path}: truncated safetensors file (header cut off)")
        try:
            header = json.loads(self._file.read(n))
        except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
            header = None
        if not isinstance(header, dict):
            raise DecodertError(f"{self.path}: corrupt safetensors header")
        header.pop("__metadata__", None)
        return 8 + n, header

    def _check(self, key: str, entry: Any, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
        """Validate one header entry: known dtype, non-negative int shape and offsets, inside the file."""
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (_int_list(shape) and _int_list(offsets) and len(offsets) == 2 and isinstance(dtype, str)):
            raise DecodertError(f"{self.path}: corrupt safetensors header entry for '{key}'")
        if dtype not in _DTYPES:
            raise DecodertError(f"{self.path}: tensor '{key}' has unsupported dtype {dtype}")
        start, end = offsets
        nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize  # python ints: no overflow
        if not start <= end or end - start != nbytes:
            raise DecodertError(
                f"{self.path}: tensor '{key}' offsets {start}..{end} do not match its shape {list(shape)}"
            )
        if end > data_size:
            raise DecodertError(
                f"{self.path}: tensor '{key}' ends at byte {self._base + end} past the end of the file "
                f"({self._base + data_size} bytes; truncated?)"
            )
        return dtype, tuple(shape), start, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> str:
        """The stored element type's safetensors name ("I32", "F16", "BF16", ...)."""
        return self._entries[key][0]

    def read(self, key: str) -> np.ndarray:
        """A fresh float32 copy of tensor `key`."""
        dtype, shape, start, end = self._entries[key]
        raw = self._stored(key).reshape(-1)
        out = bf16_to_f32(raw) if dtype == "BF16" else raw.astype(np.float32)
        return out.reshape(shape)

    def raw(self, key: str) -> np.ndarray:
        """A copy of tensor `key` in its stored type (bf16: float32): packed int32 words stay words."""
        dtype, shape, _, _ = self._entries[key]
        raw = self._stored(key)
        return (bf16_to_f32(raw) if dtype == "BF16" else raw.copy()).reshape(shape)

    def _stored(self, key: str) -> np.ndarray:
        dtype, shape, start, end = self._entries[key]
        count = (end - start) // np.dtype(_DTYPES[dtype]).itemsize
        if count == 0 or self._mm is None:
            return np.zeros(0, _DTYPES[dtype])
        return np.frombuffer(self._mm, dtype=_DTYPES[dtype], count=count, offset=self._base + start)

    def raw_row(self, key: str, row: int) -> np.ndarray:
        """Row ``row`` of tensor ``key`` (its first axis: an expert) in the stored dtype, copied: only its bytes are read."""
        dtype, shape, start, end = self._entries[key]
        if not shape or not 0 <= row < shape[0]:
            raise DecodertError(f"{self.path}: tensor '{key}' {list(shape)} has no row {row}")
        count = math.prod(shape[1:])
        size = count * np.dtype(_DTYPES[dtype]).itemsize
        if count == 0 or self._mm is None:
            return np.zeros(shape[1:], _DTYPES[dtype])
        raw = np.frombuffer(self._mm, dtype=_DTYPES[dtype], count=count, offset=self._base + start + row * size)
        return raw.reshape(shape[1:]).copy()

    def read_row(self, key: str, row: int) -> np.ndarray:
        """Row ``row`` of tensor ``key`` as a fresh float32 array."""
        raw = self.raw_row(key, row)
        return bf16_to_f32(raw) if self._entries[key][0] == "BF16" else raw.astype(np.float32)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._file.close()
