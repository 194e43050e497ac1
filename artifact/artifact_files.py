"""The files of an artifact: their size and hashes (``FileRecord``), checking them against the manifest, and writing
one atomically with the mode the user's umask gives (``write_atomic``: engines, the trt backend's runtime cache)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Mapping

from decodert.errors import DecodertError
from decodert.artifact.records import Record

_EDGE = 1 << 20  # fast verification hashes the first and last MiB


@dataclasses.dataclass(frozen=True)
class FileRecord(Record):
    size: int
    sha256: str
    edge_sha256: str | None = None  # sha256 of the size and the first and last MiB ("fast" verification)


def file_record(path: Path) -> FileRecord:
    return FileRecord(size=path.stat().st_size, sha256=sha256_file(path), edge_sha256=edge_hash(path))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def edge_hash(path: Path) -> str:
    """sha256 of the first and last MiB plus the size: catches truncation and swapped files fast."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(size - _EDGE, _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()


def verify_files(folder: Path, files: Mapping[str, FileRecord], full: bool = False) -> None:
    """Sizes always; then the edge hash (fast) or the whole sha256 (full). Names the bad file."""
    for name, rec in files.items():
        p = folder / name
        if not p.is_file():
            raise DecodertError(f"{p}: missing (listed in the manifest)")
        size = p.stat().st_size
        if size != rec.size:
            raise DecodertError(f"{p}: size {size} does not match the manifest ({rec.size}); the file is damaged")
        if full:
            ok = sha256_file(p) == rec.sha256
        else:
            ok = rec.edge_sha256 is None or edge_hash(p) == rec.edge_sha256
        if not ok:
            raise DecodertError(f"{p}: sha256 does not match the manifest; the file is damaged or was replaced")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path`` and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; the artifact's files follow the umask
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_mode() -> int:
    """The mode a new file gets under the user's umask (for files made by mkstemp, which uses 0600)."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask
