"""The weights file: tensors streamed into one external-data file that both graphs reference, and the
artifact's float dtypes as numpy types (``NUMPY_DTYPES``, which the runtime reads too).

Each tensor is converted to the target dtype and written as soon as it is produced, so export
holds one tensor at a time, never the whole model. Offsets are aligned for mmap-friendly reads.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
from onnx import TensorProto

from decodert.plugins.onnx_builder import DTYPES

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
ALIGN = 64


class WeightsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.location = self.path.name
        self._f = open(self.path, "wb")
        self.offset = 0
        self.tensors: dict[str, TensorProto] = {}

    def add(self, name: str, array: np.ndarray, dtype: str) -> TensorProto:
        """A float tensor converted to ``dtype`` (fp32 | fp16 | bf16)."""
        data = np.ascontiguousarray(array.astype(NUMPY_DTYPES[dtype], copy=False))
        return self.add_raw(name, data, DTYPES[dtype], data.shape)

    def add_raw(self, name: str, data: np.ndarray, data_type: int, dims: tuple[int, ...]) -> TensorProto:
        """Bytes as they are (e.g. packed int4), declared with an ONNX ``data_type`` and ``dims``."""
        data = np.ascontiguousarray(data)
        pad = -self.offset % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        data.tofile(self._f) if data.nbytes else None
        t = TensorProto(name=name, data_type=data_type, dims=list(dims))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(data.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.offset += data.nbytes
        self.tensors[name] = t
        return t

    def add_stacked(self, name: str, parts, dtype: str, dims: tuple[int, ...]) -> TensorProto:
        """A float tensor [n, ...] written one part [...] at a time (``parts`` yields n arrays), so
        only one part is ever held: a layer's experts are read, converted and written one by one."""
        np_dtype, done = NUMPY_DTYPES[dtype], 0
        pad = -self.offset % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        start = self.offset
        for part in parts:
            if tuple(part.shape) != tuple(dims[1:]):
                raise ValueError(f"{name}: part {done} has shape {part.shape}, expected {dims[1:]}")
            data = np.ascontiguousarray(part.astype(np_dtype, copy=False))
            data.tofile(self._f)
            self.offset += data.nbytes
            done += 1
        if done != dims[0]:
            raise ValueError(f"{name}: {done} parts written, expected {dims[0]}")
        t = TensorProto(name=name, data_type=DTYPES[dtype], dims=list(dims))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(self.offset - start))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.tensors[name] = t
        return t

    def close(self) -> int:
        self._f.close()
        return self.offset

    def __enter__(self) -> "WeightsWriter":
        return self

    def __exit__(self, *exc) -> None:
        if not self._f.closed:
            self._f.close()
