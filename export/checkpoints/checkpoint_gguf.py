"""GGUF files: metadata -> ModelSpec, tensors dequantised one at a time with the `gguf` package."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint import Checkpoint, build_spec, one_line
from decodert.export.checkpoints.gguf_header import check_gguf
from decodert.export.quantize.quant import QuantizedWeight
from decodert.export.quantize.quant_gguf import EXACT_BITS, concat_rows, take_rows, transcode
from decodert.export.lowering.semantics import check_finite, check_tensors_used
from decodert.models import family_for

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")  # MXFP4: gpt-oss experts
# Large tokenizer arrays stay out of `meta` and are read only by write_tokenizer.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type")


def read_metadata(reader: Any, include_tokenizer_arrays: bool = False) -> dict[str, Any]:
    """GGUF key -> python value (str, int, float, bool or list)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (key in TOKENIZER_ARRAYS and not include_tokenizer_arrays):
            continue
        try:
            meta[key] = field.contents()
        except UnicodeDecodeError:
            raise DecodertError(f"metadata '{key}' holds text that is not valid UTF-8") from None
    return meta


class GGUFCheckpoint(Checkpoint):
    kind = "gguf"

    def __init__(self, path: Path) -> None:
        self.source = path
        check_gguf(path)  # every declared count and size against the file, before GGUFReader trusts them
        try:
            self.reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # anything the walk let through is still a damaged file, not a crash
            raise DecodertError(f"{path}: not a readable GGUF file, truncated or corrupt ({one_line(e)})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        try:
            self.meta = read_metadata(self.reader)
        except DecodertError as e:
            raise DecodertError(f"{path}: {e}") from None
        arch = self.meta.get("general.architecture", "<missing general.architecture>")
        self.family = family = family_for(arch, str(path))
        if "token_embd.weight" in self._tensors:  # vocab_size is optional metadata
            self.meta.setdefault(f"{arch}.vocab_size", self._shape("token_embd.weight")[0])
        spec = build_spec(lambda: self._spec_from_tensors(family.spec_from_gguf(self.meta), family), path,
                          len(self._tensors))
        super().__init__(path, spec, family, family.gguf_weights)

    def _spec_from_tensors(self, spec: Any, family: Any) -> Any:
        """Facts GGUF stores as tensors rather than metadata: tied output, rope frequency factors."""
        spec = dataclasses.replace(spec, tie_word_embeddings="output.weight" not in self._tensors)
        if "rope_factors_long.weight" in self._tensors:
            raise DecodertError("rope scaling 'longrope' is not supported yet")
        if "rope_freqs.weight" in self._tensors:
            hook = family.gguf_rope_freqs
            if hook is None:
                raise DecodertError(f"rope_freqs.weight is not supported for {spec.family}")
            spec = hook(spec, self.meta, self._read("rope_freqs.weight"))
        return spec

    def _tensor_info(self, key: str) -> Any:
        t = self._tensors.get(key)
        if t is None:
            raise DecodertError(f"{self.source}: tensor '{key}' not found in the file")
        return t

    def _shape(self, key: str) -> tuple[int, ...]:
        # GGUF lists ne[0] (the contiguous, inner dim) first: reversed = [out, in]. A family may say how a
        # stored shape reads canonically (qwen3_5: the conv's squeezed [C, K] is [C, 1, K]).
        shape = tuple(int(d) for d in reversed(self._tensor_info(key).shape.tolist()))
        hook = self.family.gguf_shape
        return hook(key, shape) if hook else shape

    def _check_key(self, key: str) -> gguf.GGMLQuantizationType:
        qtype = gguf.GGMLQuantizationType(self._tensor_info(key).tensor_type)
        if qtype.name not in SUPPORTED_TYPES:
            raise DecodertError(f"{self.source}: tensor '{key}' has type {qtype.name}, which is not supported "
                                f"(supported: {', '.join(SUPPORTED_TYPES)})")
        return qtype

    def _read(self, key: str) -> np.ndarray:
        t, qtype = self._tensor_info(key), self._check_key(key)
        try:
            w = gguf.quants.dequantize(np.asarray(t.data), qtype)
        except Exception as e:
            raise DecodertError(f"{self.source}: cannot dequantise tensor '{key}' ({one_line(e)})") from None
        return np.array(w, dtype=np.float32).reshape(self._shape(key))  # copy: never a view of the mmap

    def _read_row(self, key: str, row: int) -> np.ndarray:
        """One expert of a stacked ``*_exps`` tensor: only its blocks are dequantised."""
        t, qtype = self._tensor_info(key), self._check_key(key)
        try:
            w = gguf.quants.dequantize(np.asarray(t.data)[row], qtype)
        except Exception as e:
            raise DecodertError(f"{self.source}: cannot dequantise row {row} of tensor '{key}' ({one_line(e)})") from None
        return np.array(w, dtype=np.float32).reshape(self._shape(key)[1:])

    def _fix(self, key: str, w: np.ndarray) -> np.ndarray:
        fix = self.family.gguf_fix
        return fix(key, w, self.spec) if fix else w

    def _row_order(self, key: str) -> np.ndarray | None:
        """The family quirk as a row order (row i of the fixed tensor = stored row order[i]),
        found by fixing a column of row numbers; None when the quirk does more than reorder rows."""
        rows = self._shape(key)[0]
        order = np.asarray(self._fix(key, np.arange(rows).reshape(rows, 1))).reshape(-1)
        return order if np.array_equal(np.sort(order), np.arange(rows)) else None

    def stored_type(self, name: str) -> str:
        """GGUF's type name of every part of canonical weight ``name`` ("Q4_1", "F32"...), or "mixed"."""
        types = {self._check_key(key).name for key in self._parts(name)}
        return types.pop() if len(types) == 1 else "mixed"

    def block_type(self, name: str) -> str | None:
        keys = self._parts(name)
        types = {self._check_key(key).name for key in keys}
        kind = types.pop() if len(types) == 1 else None
        if kind not in EXACT_BITS or any(self._row_order(key) is None for key in keys):
            return None
        return kind

    def blocks(self, name: str) -> QuantizedWeight:
        kind = self.block_type(name)
        if kind is None:
            return super().blocks(name)
        parts = []
        for key in self._parts(name):
            n, k = self._shape(key)
            try:
                qw = transcode(np.asarray(self._tensor_info(key).data), kind, n, k)
            except ValueError as e:
                raise DecodertError(f"{self.source}: cannot read the {kind} blocks of tensor '{key}' ({one_line(e)})") from None
            check_finite([qw.scales, qw.mins], key, self.source)
            order = self._row_order(key)
            parts.append(qw if order is None or (order == np.arange(n)).all() else take_rows(qw, order))
        return concat_rows(parts)  # fused rows: q|k|v, gate|up

    def write_tokenizer(self, out_dir: str | Path) -> dict[str, Any]:
        from decodert.export.checkpoints.gguf_tokenizer import write_gguf_tokenizer

        try:
            meta = read_metadata(self.reader, True)
        except DecodertError as e:
            raise DecodertError(f"{self.source}: {e}") from None
        return write_gguf_tokenizer(meta, Path(out_dir), self.source)

    def close(self) -> None:
        self._tensors = {}


def open_gguf(path: Path) -> GGUFCheckpoint:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DecodertError(f"{path}: not a GGUF file (bad magic)")
    ckpt = GGUFCheckpoint(path)
    ckpt.validate()
    used = ckpt.used_keys() | {"rope_freqs.weight"}  # rope_freqs is read into the spec
    check_tensors_used(ckpt._tensors, used, ckpt.spec.num_layers, path, ckpt.family.gguf_unused)
    return ckpt
