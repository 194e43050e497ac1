"""``seq2seq.json``: the record of an encoder-decoder artifact (Whisper; export/seq2seq_export.py writes it,
runtime/audio/whisper.py reads it), beside what ``manifest.json`` is for the decoder-only graphs.

    {"format": "decodert-seq2seq", "format_version": 1, "family": "whisper", "target": "ort", "dtype": "fp32",
     "max_batch": 4, "spec": WhisperSpec.to_dict(), "features": MelSettings + window_samples,
     "generation": the forced prompt's ids and the suppressed tokens, "graphs": {"encoder": file, "decoder": file},
     "files": {name: FileRecord},
     "engines": {"encoder" | "decoder": EngineRecord}}     (after `decodert build`: export/trt_seq2seq.py)

Its files are checked as a manifest's are (artifact/artifact_files.py: sizes, then the first and last MiB's hash
or, with verify="full", the whole sha256).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from decodert.artifact.artifact_files import FileRecord, file_record, verify_files, write_atomic
from decodert.artifact.manifest import VERIFY_MODES, GraphRecord, from_json, safe_name
from decodert.artifact.records import read_record, to_json
from decodert.plugins.onnx_builder import DTYPES
from decodert.errors import DecodertError

SEQ2SEQ_MANIFEST = "seq2seq.json"
FORMAT = "decodert-seq2seq"
FORMAT_VERSION = 1
_KEYS = ("family", "target", "dtype", "max_batch", "spec", "features", "generation", "graphs", "files")


def is_seq2seq_artifact(folder: str | Path) -> bool:
    return (Path(folder) / SEQ2SEQ_MANIFEST).is_file()


def write_seq2seq(folder: Path, record: dict[str, Any], files: list[str]) -> dict[str, Any]:
    """Write ``folder/seq2seq.json``: ``record`` with the format and the FileRecord of each of ``files``."""
    out = {"format": FORMAT, "format_version": FORMAT_VERSION, **record,
           "files": {n: to_json(file_record(folder / n)) for n in files}}
    (folder / SEQ2SEQ_MANIFEST).write_text(json.dumps(out, indent=2))
    return out


def write_engines(folder: Path, record: dict[str, Any], engines: dict[str, Any]) -> None:
    """Rewrite ``folder/seq2seq.json`` as ``record`` with ``engines`` (name -> an EngineRecord's JSON), atomically."""
    write_atomic(folder / SEQ2SEQ_MANIFEST, json.dumps({**record, "engines": engines}, indent=2).encode())


def graph_record(path: Path) -> GraphRecord:
    """A graph file's I/O as a manifest GraphRecord (symbolic dims by their names): what ``decodert build`` checks the
    parsed network against and the trt backend checks an engine against (seq2seq.json names the files only)."""
    import onnx

    if not path.is_file():
        raise DecodertError(f"{path} not found (seq2seq.json names it)")
    g = onnx.load(str(path), load_external_data=False).graph
    names = {v: k for k, v in DTYPES.items()}

    def info(v: Any) -> dict[str, Any]:
        t = v.type.tensor_type
        return {"name": v.name, "dtype": names[t.elem_type],
                "shape": [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]}

    return from_json(GraphRecord, {"file": path.name, "inputs": [info(v) for v in g.input],
                                   "outputs": [info(v) for v in g.output]}, path.name)


def read_seq2seq(folder: str | Path, verify: str = "fast") -> dict[str, Any]:
    """The checked record of ``folder``; each problem one DecodertError line naming it."""
    if verify not in VERIFY_MODES:
        raise DecodertError(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
    folder = Path(folder)
    path = folder / SEQ2SEQ_MANIFEST
    try:
        record = json.loads(path.read_bytes())
    except OSError as e:
        raise DecodertError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise DecodertError(f"{path}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise DecodertError(f"{path}: not a decodert seq2seq record (format {FORMAT!r})")
    if record.get("format_version") != FORMAT_VERSION:
        raise DecodertError(f"{path}: format_version {record.get('format_version')!r}; this decodert reads "
                            f"{FORMAT_VERSION} (export it again)")
    missing = [k for k in _KEYS if not isinstance(record.get(k), (dict, str, int))]
    if missing:
        raise DecodertError(f"{path}: '{missing[0]}' is missing or malformed")
    files = {n: read_record(FileRecord, r, f"{path}: files.{n}") for n, r in record["files"].items()}
    for name in [*files, *record["graphs"].values()]:
        if not isinstance(name, str) or not safe_name(name) or name not in files:
            raise DecodertError(f"{path}: file {name!r} is not a listed file of the artifact folder")
    if verify != "none":
        verify_files(folder, files, full=verify == "full")
    return record
