"""Rewrite an exported artifact's graphs without decodert plugin nodes (the ONNX Runtime reference of a ``--plugins`` export)."""

from __future__ import annotations

from pathlib import Path

from decodert.artifact.artifact_files import file_record
from decodert.artifact.manifest import GRAPHS, load_manifest, write_manifest
from decodert.plugins.expand import expand_file


def expand_artifact(folder: str | Path) -> None:
    """Rewrite an artifact's graphs without plugin nodes (weights.bin untouched), e.g. so ONNX
    Runtime can run a ``--plugins`` export as the reference for its TensorRT engines."""
    folder = Path(folder)
    m = load_manifest(folder)
    files = dict(m.files)
    for kind in GRAPHS:
        path = folder / m.graphs[kind].file
        expand_file(str(path), str(path))
        files[path.name] = file_record(path)
    write_manifest(folder, m.replace(files=files))
