"""``open_checkpoint(path)``: an HF folder (config.json + safetensors) or a .gguf file -> Checkpoint."""

from __future__ import annotations

from pathlib import Path

from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint import Checkpoint
from decodert.export.checkpoints.checkpoint_gguf import open_gguf
from decodert.export.checkpoints.checkpoint_hf import open_hf


def open_checkpoint(path: str | Path) -> Checkpoint:
    """An HF folder (config.json + safetensors) or a .gguf file -> Checkpoint."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DecodertError(f"{p}: no such file or directory")
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if p.is_dir():
        return open_hf(p)
    if not p.is_file():  # a FIFO would block open() forever; a device is endless
        raise DecodertError(f"{p}: not a regular file or a folder (a FIFO, device or socket)")
    if p.suffix.lower() == ".gguf" or _is_gguf(p):
        return open_gguf(p)
    raise DecodertError(f"{p}: not a Hugging Face checkpoint folder or a GGUF file")


def _is_gguf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise DecodertError(f"{p}: cannot read ({e.strerror})") from None
