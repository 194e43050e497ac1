"""``prepare_model(MODEL)``: smollm2 | a .gguf file | an HF folder | an artifact folder -> an artifact folder.

A checkpoint is exported once (ort, fp32) into the cache; later calls reuse that export.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from decodert.errors import DecodertError
from decodert.export.fetch import SMOLLM2, cache_dir, smollm2_gguf


def prepare_model(model: str) -> Path:
    """MODEL (smollm2 | .gguf | HF folder | artifact folder) -> an exported artifact folder."""
    if model == SMOLLM2:
        return _export_once(smollm2_gguf())
    path = Path(model).expanduser()
    if (path / "manifest.json").is_file():
        return path
    if (path.is_file() and path.suffix == ".gguf") or (path / "config.json").is_file():
        return _export_once(path)
    raise DecodertError(f"unknown model '{model}': use '{SMOLLM2}', a .gguf file, an HF folder or an artifact folder")


def _export_once(src: Path) -> Path:
    """Export ``src`` into the cache (ort, fp32) unless an earlier run did; return the artifact folder."""
    src = src.resolve()
    stamp = f"{src}:{src.stat().st_mtime_ns}".encode()
    out = cache_dir() / "artifacts" / f"{src.stem}-{hashlib.sha256(stamp).hexdigest()[:10]}-ort-fp32"
    if (out / "manifest.json").is_file():
        return out
    from decodert.export.pipeline import export_model

    print(f"decodert: exporting {src.name} to {out} (once)", file=sys.stderr)
    export_model(src, out, target="ort", dtype="fp32", max_seq=2048, max_batch=4)
    return out
