"""Walk a GGUF file's header with every declared count, length and size checked against the file.

``gguf.GGUFReader`` trusts the header: an array declaring 2**62 elements makes it loop (a hang),
a tensor declaring more bytes than the file holds gives short views, nested arrays recurse
without limit. ``check_gguf(path)`` walks the same structure first, reading only the header
(numeric arrays are skipped, not read), and raises a one-line DecodertError naming the byte
offset of the first bad field; only a file that passes is handed to ``GGUFReader``.

Layout (v2/v3, either byte order): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
kv_count x (string key, u32 type, value), tensor_count x (string name, u32 n_dims,
u64 dims[n_dims], u32 ggml type, u64 offset), padding to ``general.alignment``, tensor data.
A string is u64 length + UTF-8 bytes; an array is u32 item type + u64 count + items.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from decodert.errors import DecodertError

STRING, ARRAY = 8, 9
# value type -> struct code of the scalar types
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 3  # arrays of arrays of arrays; deeper is refused, not recursed into
DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFLayout:
    """What the walk learnt; ``fields`` lists (offset, struct code, what) of every header number."""

    version: int = 0
    byte_order: str = "<"
    n_tensors: int = 0
    n_kv: int = 0
    data_offset: int = 0
    alignment: int = DEFAULT_ALIGNMENT
    fields: list[tuple[int, str, str]] | None = None  # filled only when walk_gguf(record=True)


class _Cursor:
    def __init__(self, buf: Any, size: int, order: str, layout: GGUFLayout) -> None:
        self.buf, self.size, self.order, self.pos, self.layout = buf, size, order, 0, layout

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise DecodertError(f"{what} at byte {self.pos} needs {n} bytes but the file has {self.size - self.pos} "
                                "left (truncated or corrupt)")

    def num(self, code: str, what: str) -> Any:
        n = struct.calcsize(code)
        self.need(n, what)
        if self.layout.fields is not None:
            self.layout.fields.append((self.pos, code, what))
        value = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> bytes:
        length = self.num("Q", f"length of {what}")
        self.need(length, what)
        data = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        return data

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodertError(f"{what} at byte {self.pos - len(raw)} is not valid UTF-8") from None


def _value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """Read (scalars, strings) or skip (numeric arrays) one value; returns scalars only."""
    if vtype in SCALARS:
        return cur.num(SCALARS[vtype], what)
    if vtype == STRING:
        cur.string(what)
        return None
    if vtype != ARRAY:
        raise DecodertError(f"{what} at byte {cur.pos - 4} has unknown value type {vtype}")
    if depth >= MAX_NESTING:
        raise DecodertError(f"{what} nests arrays more than {MAX_NESTING} deep")
    itype = cur.num("I", f"item type of {what}")
    count = cur.num("Q", f"length of {what}")
    item = struct.calcsize(SCALARS[itype]) if itype in SCALARS else 8 if itype == STRING else 12
    cur.need(count * item, f"{count} items of {what}")  # the smallest each item can be
    if itype in SCALARS:
        cur.pos += count * item  # skipped, not read
    else:
        for i in range(count):
            _value(cur, itype, f"{what}[{i}]", depth + 1)
    return None


def _tensor_info(cur: _Cursor, names: set[str]) -> tuple[str, int, int]:
    """One tensor info -> (name, data offset relative to the data section, byte size)."""
    name = cur.text(f"name of tensor {len(names)}")
    if name in names:
        raise DecodertError(f"tensor '{name}' is listed twice")
    names.add(name)
    n_dims = cur.num("I", f"n_dims of tensor '{name}'")
    if not 1 <= n_dims <= MAX_DIMS:
        raise DecodertError(f"tensor '{name}' has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
    dims = [cur.num("Q", f"dim {i} of tensor '{name}'") for i in range(n_dims)]
    raw_type = cur.num("I", f"type of tensor '{name}'")
    offset = cur.num("Q", f"data offset of tensor '{name}'")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
    except (ValueError, KeyError):
        raise DecodertError(f"tensor '{name}' has unknown ggml type {raw_type}") from None
    if dims[0] % block:
        raise DecodertError(f"tensor '{name}' row length {dims[0]} is not a multiple of its block size {block}")
    n_elements = 1
    for d in dims:
        n_elements *= d  # python ints: no overflow
    return name, offset, n_elements // block * type_size


def _order(buf: Any, size: int) -> str:
    if size < 24:
        raise DecodertError(f"{size} bytes is too short for a GGUF header (truncated)")
    if bytes(buf[:4]) != b"GGUF":
        raise DecodertError("not a GGUF file (bad magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    return ">" if version & 0xFFFF == 0 else "<"  # as GGUFReader: a byte-swapped file reads 0x0N000000


def walk_gguf(buf: Any, size: int, record: bool = False) -> GGUFLayout:
    """Validate the header in ``buf`` (bytes or mmap of ``size`` bytes); DecodertError when bad.

    ``record=True`` lists every header number in ``layout.fields`` (the fuzzer mutates them)."""
    layout = GGUFLayout(byte_order=_order(buf, size), fields=[] if record else None)
    cur = _Cursor(buf, size, layout.byte_order, layout)
    cur.pos = 4
    layout.version = cur.num("I", "version")
    if layout.version not in (2, 3):
        raise DecodertError(f"GGUF version {layout.version} is not supported (2 or 3)")
    layout.n_tensors = cur.num("Q", "tensor count")
    layout.n_kv = cur.num("Q", "metadata count")
    cur.need(layout.n_kv * 13 + layout.n_tensors * 24, f"{layout.n_kv} metadata entries and {layout.n_tensors} tensors")
    keys: set[str] = set()
    for _ in range(layout.n_kv):
        key = cur.text(f"metadata key {len(keys)}")
        if key in keys:
            raise DecodertError(f"metadata key '{key}' appears twice")
        keys.add(key)
        vtype = cur.num("I", f"type of '{key}'")
        value = _value(cur, vtype, f"'{key}'")
        if key == "general.alignment":
            if vtype != 4 or not value or value & (value - 1):
                raise DecodertError(f"general.alignment must be a power-of-two uint32 (got {value!r})")
            layout.alignment = value
    names: set[str] = set()
    tensors = [_tensor_info(cur, names) for _ in range(layout.n_tensors)]
    layout.data_offset = -(-cur.pos // layout.alignment) * layout.alignment
    expected = 0  # as in ggml: each tensor's data starts where the previous one's (padded) ends
    for name, offset, nbytes in tensors:
        if offset % layout.alignment:
            raise DecodertError(f"tensor '{name}' data offset {offset} is not aligned to {layout.alignment}")
        if offset != expected:
            raise DecodertError(f"tensor '{name}' data offset {offset} is not {expected}, where the previous tensor's "
                                "data ends (tensor data overlaps, is shared or leaves a gap)")
        expected = offset + -(-nbytes // layout.alignment) * layout.alignment
        end = layout.data_offset + offset + nbytes
        if end > size:
            raise DecodertError(f"tensor '{name}' ends at byte {end} past the end of the file ({size} bytes; truncated?)")
    return layout


def check_gguf(path: Path) -> GGUFLayout:
    """Walk ``path``'s header (mmapped, nothing large is read); DecodertError names the file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise DecodertError("empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return walk_gguf(buf, size)
    except OSError as e:
        raise DecodertError(f"{path}: cannot read ({e.strerror})") from None
    except DecodertError as e:
        raise DecodertError(f"{path}: {e}") from None
