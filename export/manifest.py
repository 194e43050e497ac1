"""manifest.json: the artifact's contract (model spec, graph I/O, files and their hashes).

Written last, atomically, so a folder with a manifest is a complete artifact. Loading validates
the structure and (by default, cheaply) the files it names.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError

FORMAT = "decodert-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_EDGE = 1 << 20  # fast verification hashes the first and last MiB

_REQUIRED = {
    "format": str, "format_version": int, "model": dict, "target": str, "dtype": str, "max_seq": int,
    "max_batch": int, "kv": dict, "graphs": dict, "weights": dict, "tokenizer": dict, "files": dict,
}


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


def file_record(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path), "edge_sha256": edge_hash(path)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Atomically write ``folder/manifest.json`` (temp file + rename)."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def load_manifest(folder: Path | str, verify: str = "fast") -> dict[str, Any]:
    """Read and validate ``folder/manifest.json``; verify files: "none" | "fast" | "full"."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise DecodertError(f"{folder}: not a folder (expected an artifact made by 'decodert export')")
    if not path.is_file():
        raise DecodertError(f"{path}: missing; {folder} is not a decodert artifact (run 'decodert export' first)")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DecodertError(f"{path}: not valid JSON ({e})") from None
    validate_manifest(manifest, path)
    if verify != "none":
        verify_files(folder, manifest, full=verify == "full")
    return manifest


def validate_manifest(m: Any, path: Path) -> None:
    if not isinstance(m, dict):
        raise DecodertError(f"{path}: expected a JSON object")
    for key, typ in _REQUIRED.items():
        if not isinstance(m.get(key), typ):
            raise DecodertError(f"{path}: field '{key}' is missing or not a {typ.__name__}")
    if m["format"] != FORMAT or m["format_version"] != FORMAT_VERSION:
        raise DecodertError(f"{path}: format {m['format']!r} v{m['format_version']} is not {FORMAT} v{FORMAT_VERSION}")
    for kind in ("prefill", "decode"):
        g = m["graphs"].get(kind)
        if not isinstance(g, dict) or not isinstance(g.get("file"), str) or not isinstance(g.get("inputs"), list):
            raise DecodertError(f"{path}: graphs.{kind} is missing or malformed")
    for name, rec in m["files"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("size"), int) or not isinstance(rec.get("sha256"), str):
            raise DecodertError(f"{path}: files.{name} is malformed")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise DecodertError(f"{path}: file entry '{name}' points outside the artifact folder")


def verify_files(folder: Path, manifest: dict[str, Any], full: bool = False) -> None:
    """Sizes always; then the edge hash (fast) or the whole sha256 (full). Names the bad file."""
    for name, rec in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            raise DecodertError(f"{p}: missing (listed in the manifest)")
        size = p.stat().st_size
        if size != rec["size"]:
            raise DecodertError(f"{p}: size {size} does not match the manifest ({rec['size']}); the file is damaged")
        if full:
            ok = sha256_file(p) == rec["sha256"]
        else:
            ok = rec.get("edge_sha256") is None or edge_hash(p) == rec["edge_sha256"]
        if not ok:
            raise DecodertError(f"{p}: sha256 does not match the manifest; the file is damaged or was replaced")
