"""``prepare_model(MODEL)``: smollm2 | a .gguf file | an HF folder | an artifact folder -> an artifact folder.

``decodert run MODEL`` and ``LLM.load(MODEL)`` share it. A checkpoint is exported once (ort
target) into the cache, ``$DECODERT_CACHE/artifacts`` (default ``~/.cache/decodert``); later
calls with the same file and settings reuse that export. By default (``quant="auto"``) the
export keeps the checkpoint's own precision where answers hold (export/checkpoints/source_precision.py: a
Q4_0 GGUF stays exact int4; a Q4_1 GGUF and a float checkpoint become fp32) and ``max_seq`` is min(the model's context, 2048).
These exports also hold embed.onnx where the model's layers allow it, so ``LLM.embed`` and ``/v1/embeddings`` work
on ``decodert serve smollm2`` (``decodert export`` writes it only when asked: ``--embeddings``).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError
from decodert.export.fetch import SMOLLM2, cache_dir, smollm2_gguf
from decodert.artifact.manifest import MANIFEST
from decodert.artifact.seq2seq import is_seq2seq_artifact, read_seq2seq
from decodert.export.seq2seq_export import is_encoder_decoder

QUANT_CHOICES = ("auto", "none", "int4", "int8")  # auto: keep the checkpoint's precision; none: fp32
ARTIFACTS = "artifacts"  # the cache's folder of exports


def is_checkpoint_source(model: str | Path) -> bool:
    """True for what ``prepare_model`` exports: the name 'smollm2', a .gguf file or an HF folder."""
    path = Path(model).expanduser()
    if (path / MANIFEST).is_file() or is_seq2seq_artifact(path):
        return False
    return (str(model) == SMOLLM2 and not path.exists()) or (path.is_file() and path.suffix.lower() == ".gguf") \
        or (path / "config.json").is_file()


def prepare_model(model: str | Path, max_seq: int | None = None, quant: str = "auto",
                  progress: bool | None = None) -> Path:
    """MODEL (smollm2 | .gguf | HF folder | artifact folder) -> an exported artifact folder.

    ``max_seq`` and ``quant`` (auto | none | int4 | int8) choose the export of a checkpoint; for
    an artifact folder they must agree with it (it is used as it is, never re-exported).
    """
    if quant not in QUANT_CHOICES:
        raise DecodertError(f"--quant {quant!r}: expected one of {', '.join(QUANT_CHOICES)}")
    path = Path(model).expanduser()
    if is_seq2seq_artifact(path) or is_encoder_decoder(path):  # Whisper: one export, fp32 (export/seq2seq_export.py)
        return _seq2seq(path, max_seq, quant, progress)
    if (path / MANIFEST).is_file():
        _check_artifact(path, max_seq, quant)
        return path
    if str(model) == SMOLLM2 and not path.exists():
        return export_once(smollm2_gguf(), max_seq, quant, progress)
    if is_checkpoint_source(path):
        return export_once(path, max_seq, quant, progress)
    raise DecodertError(f"unknown model '{model}': use '{SMOLLM2}', a .gguf file, an HF folder or an artifact folder")


def _seq2seq(path: Path, max_seq: int | None, quant: str, progress: bool | None) -> Path:
    """An encoder-decoder artifact as it is, or its checkpoint exported once into the cache (fp32, the ort target)."""
    if quant not in ("auto", "none") or max_seq is not None:
        raise DecodertError(f"{path}: an encoder-decoder model (whisper) runs in fp32 at its own decoder length; "
                            "--quant and --max-seq do not apply")
    if is_seq2seq_artifact(path):
        return path
    src = path.resolve()
    stat = (src / "config.json").stat()
    stamp = f"{src}:{stat.st_mtime_ns}:{stat.st_size}:seq2seq".encode()
    out = cache_dir() / ARTIFACTS / f"{src.stem}-{hashlib.sha256(stamp).hexdigest()[:10]}-ort-fp32-seq2seq"
    if is_seq2seq_artifact(out):
        try:
            read_seq2seq(out, verify="fast")
            return out
        except DecodertError as e:  # the cache's own copy: made again
            print(f"decodert: the cached export is damaged ({e}); exporting it again", file=sys.stderr)
    from decodert.export.pipeline import export_model

    print(f"decodert: exporting {src.name} once, fp32 (encoder-decoder), into {out}", file=sys.stderr)
    export_model(src, out, target="ort", dtype="fp32", max_batch=4, progress=progress)
    return out


def _check_artifact(path: Path, max_seq: int | None, quant: str) -> None:
    if quant != "auto":
        raise DecodertError(f"--quant {quant}: {path} is already exported; --quant applies to a checkpoint "
                            f"(re-export it with `decodert export SRC -o OUT --quant ...`)")
    if max_seq is not None:
        from decodert.artifact.manifest import load_manifest

        exported = load_manifest(path, verify="none").max_seq
        if exported != max_seq:
            raise DecodertError(f"--max-seq {max_seq}: {path} was exported with --max-seq {exported}; re-export it "
                                f"(`decodert export SRC -o OUT --max-seq {max_seq}`) or pass the checkpoint instead")


def export_choice(ckpt, quant: str) -> tuple[Any, str]:
    """(QuantConfig or None for fp32, a description) for ``quant`` = auto | none | int4 | int8."""
    from decodert.export.quantize.quant import QuantConfig
    from decodert.export.checkpoints.source_precision import keep_precision

    if quant == "auto":
        return keep_precision(ckpt)
    if quant == "none":
        return None, "fp32 (--quant none)"
    bits = int(quant[3:])
    # as `decodert export --quant`: int8 at accuracy level 4 (ORT has no fast level-0 int8 kernel on CPU)
    return QuantConfig(bits=bits, accuracy_level=4 if bits == 8 else 0), f"{quant}: rounded to nearest (--quant {quant})"


def export_once(src: Path, max_seq: int | None = None, quant: str = "auto", progress: bool | None = None) -> Path:
    """Export ``src`` into the cache unless an earlier call did with the same settings; return the artifact folder."""
    from decodert.export.checkpoints.checkpoint_open import open_checkpoint
    from decodert.export.lowering.embed_graph import embed_problem

    src = src.resolve()
    with open_checkpoint(src) as ckpt:
        config, what = export_choice(ckpt, quant)
        seq = min(ckpt.spec.max_position, 2048) if max_seq is None else max_seq
        embeddings = embed_problem(ckpt.spec) is None  # embed.onnx wherever the layers allow it (LLM.embed)
    label = "fp32" if config is None else f"int{config.bits}"
    stat = src.stat()
    stamp = f"{src}:{stat.st_mtime_ns}:{stat.st_size}:{config}:{seq}:embed".encode()  # embed.onnx (LLM.embed) too
    out = cache_dir() / ARTIFACTS / f"{src.stem}-{hashlib.sha256(stamp).hexdigest()[:10]}-ort-{label}-{seq}"
    if (out / MANIFEST).is_file():
        damage = _damage(out)
        if damage is None:
            return out
        # the cache's own copy (never a folder the user named): made again, as if it were missing
        print(f"decodert: the cached export is damaged ({damage}); exporting it again", file=sys.stderr)
    from decodert.export.pipeline import export_model

    print(f"decodert: exporting {src.name} once, {what}, max_seq {seq}, into {out}", file=sys.stderr)
    export_model(src, out, target="ort", dtype="fp32", max_seq=seq, max_batch=4, quant=config, progress=progress,
                 embeddings=embeddings)
    return out


def _damage(folder: Path) -> str | None:
    """Why a cached export cannot be opened (its manifest unreadable, a listed file missing, truncated or changed at
    its edges: the runtime's "fast" check), or None when it can."""
    from decodert.artifact.manifest import load_manifest

    try:
        load_manifest(folder, verify="fast")
    except DecodertError as e:
        return str(e)
    return None
