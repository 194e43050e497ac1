"""``decodert build OUT`` of an encoder-decoder artifact (Whisper: seq2seq.json, export/seq2seq_export.py): its
encoder.onnx and decoder.onnx, exported for the trt target, built into OUT/encoder.engine and OUT/decoder.engine
with the steps of export/trt_build.py (parse from the path, check the parsed I/O, strongly typed, one profile),
recorded in seq2seq.json ``engines`` (the EngineRecord of manifest.engines).

Profiles (B = --max-batch, default the record's max_batch; S = --max-seq, default max_target_positions / 2,
the longest prompt transformers lets a Whisper take):
    encoder: batch 1 .. B (opt B); input_features [batch, M, 2T] (M, T static)
    decoder: batch 1 .. B (opt B), seq 1 .. S (opt 1: every step after the prompt is one token);
             past_* / present_* [batch, H, max_target_positions, D] and cross_* [batch, H, T, D] static but batch
The graphs' I/O is read off the ONNX files (seq2seq.json names the files, not their tensors).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from decodert.artifact.manifest import EngineRecord, GraphRecord
from decodert.artifact.records import to_json
from decodert.artifact.seq2seq import SEQ2SEQ_MANIFEST, graph_record, read_seq2seq, write_engines
from decodert.artifact.targets import target_info
from decodert.artifact.trt_engines import make_logger
from decodert.errors import DecodertError
from decodert.export.artifact.destination import linked_copy, swap_in
from decodert.export.trt_build import open_timing_cache, build_graph, check_precision, staged, strip_problem
from decodert.artifact.artifact_files import write_atomic
from decodert.plugins.trt.compat import load_trt

def seq2seq_profile(graph: GraphRecord, batch: int, seq: int) -> dict[str, tuple[list[int], ...]]:
    """Input name -> (min, opt, max) dims over the symbolic "batch" and "seq"."""
    ranges = {"batch": (1, batch, batch), "seq": (1, 1, seq)}
    return {t.name: tuple([ranges[d][k] if isinstance(d, str) else int(d) for d in t.shape] for k in range(3))
            for t in graph.inputs}


def build_seq2seq_engines(out_dir: str | Path, precision: str | None = None, max_batch: int | None = None,
                          max_seq: int | None = None, version_compatible: bool = False,
                          timing_cache: str | Path | None = None, progress: bool = True, verify: str = "fast",
                          self_contained: bool = False) -> dict[str, EngineRecord]:
    """Build OUT/encoder.engine and OUT/decoder.engine; record them in seq2seq.json and return the records. The
    folder is updated as a whole, as export/trt_build.py build_engines does."""
    out = Path(out_dir)
    record = read_seq2seq(out, verify)
    target = target_info(str(record["target"]))
    if not target.runs_on("trt"):
        raise DecodertError(f"{out / SEQ2SEQ_MANIFEST}: the graphs were exported for --target {target.name} "
                            f"({target.about}); re-export with --target trt to build TensorRT engines")
    limit = int(record["spec"]["max_target_positions"])
    batch, seq = int(max_batch or record["max_batch"]), int(max_seq or limit // 2)
    if batch < 1:
        raise DecodertError(f"--max-batch must be >= 1 (got {batch})")
    if not 1 <= seq <= limit:
        raise DecodertError(f"--max-seq {seq} must be between 1 and the decoder's max_target_positions {limit}")
    trt, info = load_trt(need_builder=True)
    cache_path = Path(timing_cache) if timing_cache else None
    cache, note = open_timing_cache(info, trt, cache_path)
    settings = {"precision": check_precision(str(record["dtype"]), precision), "max_batch": batch, "max_seq": seq,
                "version_compatible": version_compatible, "timing_cache_obj": cache, "timing_cache_note": note,
                "progress": progress, "logger": make_logger(trt), "plugins": False,
                "strip": not self_contained and strip_problem(trt) is None}
    staging = linked_copy(out)
    work = staging or out
    try:
        engines = {}
        for name, file in record["graphs"].items():  # "encoder", "decoder"
            graph = graph_record(work / file)
            engines[name] = build_graph(trt, info, work, name, graph, seq2seq_profile(graph, batch, seq), settings)
        for rec in engines.values():
            os.replace(staged(work / rec.file), work / rec.file)
        write_engines(work, record, {n: to_json(r) for n, r in engines.items()})
        if staging is not None:
            swap_in(staging, out.resolve())
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for name in record["graphs"]:
            staged(work / f"{name}.engine").unlink(missing_ok=True)
    if cache is not None and cache_path is not None:
        write_atomic(cache_path, bytes(cache.serialize()))
    return engines
