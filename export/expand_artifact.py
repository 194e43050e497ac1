"""Rewrite an exported artifact's graphs without decodert plugin nodes (the ONNX Runtime reference of a ``--plugins`` export)."""

from __future__ import annotations

from pathlib import Path

from decodert.export.manifest import file_record, load_manifest, write_manifest
from decodert.plugins.expand import expand_file


def expand_artifact(folder: str | Path) -> None:
    """Rewrite an artifact's graphs without plugin nodes (weights.bin untouched), e.g. so ONNX
    Runtime can run a ``--plugins`` export as the reference for its TensorRT engines."""
    folder = Path(folder)
    m = load_manifest(folder)
    for kind in ("prefill", "decode"):
        path = folder / m["graphs"][kind]["file"]
        expand_file(str(path), str(path))
        m["files"][path.name] = file_record(path)
    write_manifest(folder, m)
