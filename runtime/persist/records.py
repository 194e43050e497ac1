"""State records: the one file format decodert keeps K/V, states and ids in between processes.

A record is numpy arrays and a small JSON header, checksummed; nothing else. It is never unpickled and
holds no code: the header is parsed with ``json``, each array is raw bytes cast to a dtype taken from a
fixed table (``DTYPES``), so a state file, whoever wrote it, can only ever give arrays or be refused.

    offset 0   MAGIC              8 bytes  b"DRTSTATE"
           8   header length      4 bytes  little-endian uint32 (at most MAX_HEADER)
          12   header             JSON, utf-8: {"format_version", "identity", "kind", "meta",
                                   "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}]}
               payload            the arrays' C-order bytes, back to back (offsets relative to its start)
      end-32   checksum           blake2b (32 bytes) of everything before it

The rule, for writers and readers alike:

- **Written atomically** (``write_record``): a temp file in the same directory, fsync, ``os.replace``.
  A reader sees the old file, the new one, or none, never half of one; two processes writing the same
  name leave one whole record.
- **Read validated or not at all** (``read_record``): magic, format version, header, array bounds, the
  checksum over header and payload, then the identity and kind the caller expects. Any mismatch raises
  :class:`~decodert.errors.DamagedState` naming the file and what is wrong (truncated, checksum,
  another artifact, another version); a record is returned whole or not at all.
- **Identity** (``artifact_identity``): a short key of what the K/V depend on: the weights' and every
  graph's sha256 from the manifest (the vision graph's too), dtype, kv_dtype, the K/V geometry and
  ``STATE_VERSION`` (what a block's bytes mean here), plus the adapter's key where K/V were computed
  under one. The backend is not part of it: the ort and trt backends run the same graphs over the same
  cache layout. A record of another identity is refused, never converted.

Bump ``FORMAT_VERSION`` when the file layout changes and ``STATE_VERSION`` when what the arrays mean
changes (the K/V block layout, the states' order): files of either older kind are then refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from decodert.artifact.manifest import Manifest
from decodert.artifact.records import to_json
from decodert.errors import DamagedState, DecodertError

MAGIC = b"DRTSTATE"
FORMAT_VERSION = 1  # the file layout above
STATE_VERSION = 1  # what the arrays mean (kv_blocks.py block layout [2L, H_kv, n, D], KVCache.read_states order)
MAX_HEADER = 1 << 20
_DIGEST = 32
_PREFIX = struct.Struct("<8sI")

# The only element types a record holds: name -> numpy dtype (no object or structured dtypes).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "int64": np.dtype(np.int64), "int32": np.dtype(np.int32),
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class StateRecord:
    """A record as read back: what it holds (``kind``), its small JSON ``meta`` and its arrays by name."""

    identity: str
    kind: str  # "prefix-block" (runtime/persist/disk_tier.py), "session" (runtime/chat/session.py), ...
    meta: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]


# ---------------------------------------------------------------- identity
def artifact_identity(manifest: Manifest, adapter: str = "") -> str:
    """A 24-hex-digit key of what an artifact's K/V depend on (see the module docstring); ``adapter``: the
    adapter's own key ("" for the base model). DecodertError when the manifest lists no hash for its weights
    or a graph (nothing stable to key the state by)."""
    files = manifest.files

    def sha(name: str, what: str) -> str:
        rec = files.get(name)
        if rec is None:
            raise DecodertError(f"manifest lists no hash for {what} {name!r}; its K/V cannot be kept on disk")
        return rec.sha256

    graphs = {kind: sha(g.file, f"graph {kind}") for kind, g in sorted(manifest.graphs.items())}
    if manifest.vision is not None:
        graphs["vision"] = sha(manifest.vision.graph.file, "graph vision")
    fields = {
        "state_version": STATE_VERSION,
        "weights": sha(manifest.weights.file, "weights"),
        "graphs": graphs,
        "dtype": manifest.dtype,
        "kv_dtype": manifest.kv_dtype or manifest.dtype,
        "kv": to_json(manifest.kv),
        "adapter": adapter,
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


# ---------------------------------------------------------------- write
def encode_record(identity: str, kind: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of a record (layout: module docstring). ``meta`` must be plain JSON; arrays of a dtype
    outside ``DTYPES`` are refused."""
    table, parts, offset = [], [], 0
    for name, value in arrays.items():
        a = np.ascontiguousarray(value)
        dtype = _NAMES.get(a.dtype)
        if dtype is None:
            raise DecodertError(f"state record: array {name!r} has dtype {a.dtype}, not one a record holds "
                                f"({', '.join(DTYPES)})")
        data = a.tobytes()
        table.append({"name": str(name), "dtype": dtype, "shape": [int(d) for d in a.shape], "offset": offset,
                      "nbytes": len(data)})
        parts.append(data)
        offset += len(data)
    header = json.dumps({"format_version": FORMAT_VERSION, "identity": identity, "kind": kind,
                         "meta": dict(meta or {}), "arrays": table}, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER:
        raise DecodertError(f"state record header is {len(header)} bytes, over {MAX_HEADER}")
    h = hashlib.blake2b(digest_size=_DIGEST)
    out = [_PREFIX.pack(MAGIC, len(header)), header, *parts]
    for part in out:
        h.update(part)
    out.append(h.digest())
    return b"".join(out)


def write_record(path: Path | str, identity: str, kind: str, arrays: Mapping[str, np.ndarray],
                 meta: Mapping[str, Any] | None = None) -> int:
    """Write a record to ``path`` atomically (temp file beside it, fsync, os.replace) -> bytes written.
    OSError (a full disk, a read-only directory) propagates after the temp file is removed."""
    path = Path(path)
    data = encode_record(identity, kind, arrays, meta)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(data)


# ---------------------------------------------------------------- read
def read_record(path: Path | str, identity: str | None = None, kind: str | None = None) -> StateRecord:
    """Read and validate the record at ``path``; ``identity`` / ``kind``: what it must be (None: any).

    DamagedState (one line naming the file) for a file that is not a record, is truncated, fails its
    checksum, is of another format version, identity or kind; OSError when it cannot be read at all."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    return decode_record(data, path, identity, kind)


def decode_record(data: bytes, path: Path | str, identity: str | None = None, kind: str | None = None) -> StateRecord:
    """``read_record`` over bytes already read (``path`` only names them in errors)."""
    def bad(what: str) -> DamagedState:
        return DamagedState(f"{path}: {what}")

    if len(data) < _PREFIX.size + _DIGEST:
        if not MAGIC.startswith(data[: len(MAGIC)]):
            raise bad("not a decodert state record (no DRTSTATE magic)")
        raise bad(f"truncated ({len(data)} bytes)")
    magic, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise bad("not a decodert state record (no DRTSTATE magic)")
    body_end = len(data) - _DIGEST
    if hlen > MAX_HEADER or _PREFIX.size + hlen > body_end:
        raise bad(f"truncated or damaged header ({len(data)} bytes, header of {hlen})")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + hlen])
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise bad("damaged header (not a JSON object)")
    version = header.get("format_version")
    if version != FORMAT_VERSION:  # before the checksum: a newer layout may checksum differently
        raise bad(f"record format version {version!r}; this decodert reads version {FORMAT_VERSION} (written by "
                  "another decodert version)")
    h = hashlib.blake2b(data[:body_end], digest_size=_DIGEST)
    if h.digest() != data[body_end:]:
        raise bad("checksum mismatch: the file is truncated or damaged")
    if identity is not None and header.get("identity") != identity:
        raise bad(f"written for another artifact, adapter or state version (identity {header.get('identity')!r}, "
                  f"expected {identity!r})")
    if kind is not None and header.get("kind") != kind:
        raise bad(f"holds {header.get('kind')!r}, not {kind!r}")
    arrays = _arrays(header.get("arrays"), memoryview(data)[_PREFIX.size + hlen : body_end], bad)
    meta = header.get("meta")
    if not isinstance(meta, dict) or not isinstance(header.get("identity"), str) or not isinstance(header.get("kind"), str):
        raise bad("damaged header (identity, kind or meta of the wrong type)")
    return StateRecord(header["identity"], header["kind"], meta, arrays)


def _arrays(table: Any, payload: memoryview, bad: Any) -> dict[str, np.ndarray]:
    if not isinstance(table, list):
        raise bad("damaged header (no array table)")
    out: dict[str, np.ndarray] = {}
    for row in table:
        ok = (isinstance(row, dict) and isinstance(row.get("name"), str) and row.get("dtype") in DTYPES
              and isinstance(row.get("shape"), list) and all(type(d) is int and d >= 0 for d in row["shape"])
              and type(row.get("offset")) is int and type(row.get("nbytes")) is int and row["offset"] >= 0)
        if not ok:
            raise bad(f"damaged array entry {row!r:.80}")
        dtype = DTYPES[row["dtype"]]
        start, n = row["offset"], row["nbytes"]
        if n != int(np.prod(row["shape"], dtype=np.int64)) * dtype.itemsize or start + n > len(payload) \
                or row["name"] in out:
            raise bad(f"array {row['name']!r} does not match its bytes (damaged)")
        out[row["name"]] = np.frombuffer(payload[start : start + n], dtype=dtype).reshape(row["shape"]).copy()
    return out
