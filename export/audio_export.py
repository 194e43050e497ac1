"""The audio half of an export: audio.onnx (over the audio weights already in weights.bin) and the manifest's
``audio`` record, with the checkpoint's log-mel settings resolved once here so the runtime needs neither
transformers nor the checkpoint folder (runtime/audio/features.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from decodert.artifact.manifest import AudioRecord, GraphRecord, from_json
from decodert.errors import DecodertError
from decodert.export.lowering.audio.graph import audio_contract, build_audio_graph
from decodert.export.lowering.lowering import Lowering
from decodert.export.vision_export import _json

AUDIO_FILE = "audio.onnx"


def audio_of(ckpt: Any) -> Any:
    """The checkpoint's audio encoder (the spec of its kind, models/audio.py KINDS), when its family declares one
    (HF folders only)."""
    read = ckpt.family.audio_from_hf
    return read(ckpt.config) if read is not None and getattr(ckpt, "config", None) is not None else None


def write_audio(ckpt: Any, audio: Any, weights: dict[str, onnx.TensorProto], dtype: str, folder: Path,
                ir_version: int, low: type[Lowering]) -> AudioRecord:
    """Write audio.onnx into ``folder`` (checked) -> the manifest's ``audio`` record."""
    path = folder / AUDIO_FILE
    onnx.save_model(build_audio_graph(audio, dtype, weights, ir_version, low), path)
    onnx.checker.check_model(str(path), full_check=True)
    graph = from_json(GraphRecord, {"file": AUDIO_FILE, **audio_contract(audio, dtype)}, "audio.graph")
    source = Path(ckpt.source)
    try:
        features = ckpt.family.audio_features(_json(source / "preprocessor_config.json"), audio)
    except DecodertError as e:
        raise DecodertError(f"{source}: preprocessor_config.json: {e}") from None
    return AudioRecord(graph=graph, spec=audio.to_dict(), features=features,
                       transcription=dict(ckpt.family.transcription) or None)
