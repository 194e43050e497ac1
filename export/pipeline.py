"""``decodert export``: checkpoint -> prefill.onnx + decode.onnx + weights.bin + tokenizer + manifest.

Everything is written into a temporary sibling folder and swapped into place at the end
(export/artifact/destination.py), so an interrupted or failed export leaves the old artifact or none.
"""

from __future__ import annotations

import datetime as dt
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from decodert.errors import DecodertError
from decodert.export.artifact import destination
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.export.lowering.graph import VERIFY_WIDTH, build_graph, io_contract, verifies_rows
from decodert.export.quantize.quant import QuantConfig, WeightQuant, quantize, quantized_embedding, write_gather_tables
from decodert.export.quantize.quant_gguf import transcoded_as
from decodert.export.checkpoints.sampling_defaults import sampling_record
from decodert.export.lowering.targets import get_target
from decodert.export.quantize.weight_layouts import WeightLayout
from decodert.export.artifact.artifact_files import file_record
from decodert.export.artifact.cache_records import StateRecord
from decodert.export.artifact.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, GraphRecord, KVRecord, Manifest, ModelRecord, PluginsRecord,
                                      QuantRecord, SamplingRecord, SourceRecord, TokenizerRecord, WeightsRecord, from_json,
                                      write_manifest)
from decodert.export.progress import Stage
from decodert.export.lowering.semantics import tokenizer_vocab
from decodert.export.artifact.weights import WeightsWriter
from decodert.models.spec import ModelSpec, canonical_names, canonical_shape, rope_tables, state_specs
from decodert.plugins.selection import choose_plugins
from decodert.export.artifact.version import __version__

DTYPES = ("fp32", "fp16", "bf16")
WEIGHTS = "weights.bin"


def export_model(src: str | Path, out_dir: str | Path, target: str = "ort", dtype: str = "fp32",
                 max_seq: int | None = None, max_batch: int = 4, progress: bool | None = None,
                 quant: QuantConfig | None = None, plugins: str = "auto", trt_version: str | None = None) -> Manifest:
    """Export ``src`` (HF folder or .gguf) into ``out_dir``; returns the manifest.

    ``plugins`` (auto|always|never, trt target): emit decodert plugin nodes instead of native
    TensorRT layers (plugins/selection.py decides ``auto`` from ``trt_version`` or the installed TensorRT).

    ``quant`` stores the linear weights block-quantized (export/quantize/quant.py); the trt target needs
    symmetric quantization (TensorRT's int4 weights have no zero point) and gets it. GGUF Q4_0 /
    Q8_0 weights that match the config are transcoded exactly instead (the rule: export/quantize/quant.py);
    ``manifest.quant.per_weight`` records how each weight is stored.
    """
    tgt = get_target(target)
    _check_settings(dtype, max_seq, max_batch)
    quant = tgt.quant_config(quant)  # TensorRT: symmetric; --keep-q4-1 only where the layout keeps block minimums
    out_dir = destination.prepare(out_dir)
    progress = True if progress is None else progress  # export/progress.py: a bar on a terminal, else lines
    with Stage(f"reading {Path(src).name}", enabled=progress):
        ckpt = open_checkpoint(src)
    spec: ModelSpec = ckpt.spec
    max_seq = min(spec.max_position, 2048) if max_seq is None else max_seq
    if not 2 <= max_seq <= spec.max_position:
        raise DecodertError(f"--max-seq {max_seq} must be between 2 and the model's context length {spec.max_position}")
    plugin_record = choose_plugins(plugins, tgt, trt_version)

    tmp = destination.make_temp(out_dir)
    try:
        layout = tgt.weight_layout
        weights, quantized = _write_weights(ckpt, spec, tmp / WEIGHTS, dtype, max_seq, progress, quant, layout)
        lowering = tgt.make_lowering(spec, dtype, max_seq, quant, quantized,
                                 plugins=tuple(plugin_record["ops"]) if plugin_record else ())
        with Stage("writing graphs and manifest", total=5, unit="step", enabled=progress) as bar:
            graphs = _write_graphs(spec, lowering, weights, dtype, max_seq, tmp, bar)
            tokenizer = ckpt.write_tokenizer(tmp)
            tokenizer["vocab_size"] = tokenizer_vocab(tmp / "tokenizer.json", spec.vocab_size, ckpt.source)
            manifest = _manifest(ckpt, spec, target, dtype, max_seq, max_batch, graphs, tokenizer, tmp)  # hashes
            bar.update()
            manifest = manifest.replace(
                sampling=from_json(SamplingRecord, sampling_record(ckpt, tokenizer.get("chat_template")), "sampling"),
                plugins=None if plugin_record is None else from_json(PluginsRecord, plugin_record, "plugins"),
                quant=_quant_record(quant, layout, quantized))
            write_manifest(tmp, manifest)
            destination.swap_in(tmp, out_dir)
            bar.update()
    except OSError as e:  # disk full, permissions, a file system that went away
        shutil.rmtree(tmp, ignore_errors=True)
        raise DecodertError(f"-o {out_dir}: writing the artifact failed ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _check_settings(dtype: str, max_seq: int | None, max_batch: int) -> None:
    if dtype not in DTYPES:
        raise DecodertError(f"unknown dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    if max_batch < 1:
        raise DecodertError(f"--max-batch must be >= 1 (got {max_batch})")
    if max_seq is not None and (not isinstance(max_seq, int) or max_seq < 2):
        raise DecodertError(f"--max-seq must be an integer >= 2 (got {max_seq!r})")


def _write_graphs(spec: ModelSpec, lowering: Any, weights: dict, dtype: str, max_seq: int, tmp: Path,
                  bar: Stage) -> dict[str, GraphRecord]:
    """prefill.onnx, decode.onnx and verify.onnx (checked) -> their manifest records."""
    graphs = {}
    for kind in ("prefill", "decode", "verify"):
        path = tmp / f"{kind}.onnx"
        onnx.save_model(build_graph(spec, lowering, weights, kind), path)
        onnx.checker.check_model(str(path), full_check=True)
        contract = {"file": path.name, **io_contract(spec, dtype, max_seq, kind, verifies_rows(lowering, kind))}
        if kind == "verify":
            contract["max_tokens"] = VERIFY_WIDTH  # per row and call (the TensorRT profile's seq max)
            contract["batched_past"] = lowering.for_graph(kind).batched_past
        graphs[kind] = from_json(GraphRecord, contract, f"graphs.{kind}")
        bar.update()
    return graphs


def _weights_stage(spec: ModelSpec, dtype: str, quant: QuantConfig | None, progress: bool) -> Stage:
    """The progress of the weights loop, counted in weights (elements) so big tensors weigh more."""
    total = sum(math.prod(canonical_shape(spec, n)) for n in canonical_names(spec))
    what = f"converting weights to {dtype}" if quant is None else f"quantizing weights to int{quant.bits}"
    return Stage(what + (" (scale search)" if quant is not None and quant.scale_search else ""), total=total,
                 unit="weights", unit_scale=True, enabled=progress)


def _write_weights(ckpt, spec: ModelSpec, path: Path, dtype: str, max_seq: int, progress: bool,
                   quant: QuantConfig | None, layout: WeightLayout) -> tuple[dict[str, onnx.TensorProto], dict[str, WeightQuant]]:
    """Stream every canonical tensor (one at a time) plus the RoPE tables into weights.bin.

    Returns the initializers and how each weight stored quantized is stored (by name).
    """
    quantized: dict[str, WeightQuant] = {}
    gather_quantized = quantized_embedding(spec, quant, layout)
    tied_head = spec.tie_word_embeddings and quant is not None and quant.lm_head
    with WeightsWriter(path) as w, _weights_stage(spec, dtype, quant, progress) as bar:
        for name in canonical_names(spec):
            tensor = None
            if quant is not None and quant.applies_to(name):
                quantized[name] = _store_quantized(w, ckpt, name, name, quant, dtype, layout)
            elif not (name == "embed" and gather_quantized):  # else the graph gathers rows from the quantized head
                tensor = ckpt.tensor(name)
                w.add(name, tensor, dtype)
            if name == "embed" and tied_head:  # tied: the head is a quantized copy of the embedding
                assert quant is not None
                quantized["lm_head"] = _store_quantized(w, ckpt, "embed", "lm_head", quant, dtype, layout,
                                                        gather=gather_quantized, tensor=tensor)
            del tensor
            bar.update(math.prod(canonical_shape(spec, name)))
        for prefix, rope in rope_tables(spec).items():  # "rope" (+ "rope_local": Gemma 3's sliding layers)
            cos, sin = rope.cos_sin(spec.head_dim, max_seq)
            w.add(f"{prefix}.cos", cos, dtype)
            w.add(f"{prefix}.sin", sin, dtype)
        w.close()
        return w.tensors, quantized


def _store_quantized(w: WeightsWriter, ckpt, src: str, name: str, quant: QuantConfig, dtype: str, layout: WeightLayout,
                     gather: bool = False, tensor: np.ndarray | None = None) -> WeightQuant:
    """Store canonical weight ``src`` quantized as ``name``: GGUF blocks transcoded where that is
    exact (export/quantize/quant_gguf.py), else rounded to nearest from float (``tensor``, if already read)."""
    wq = transcoded_as(ckpt.block_type(src), quant, layout, gathered=gather)
    if wq is not None:
        qw = ckpt.blocks(src)
    else:
        qw, wq = quantize(ckpt.tensor(src) if tensor is None else tensor, quant), quant.rtn()
    layout.write(w, name, qw, wq, dtype)
    if gather:  # GatherBlockQuantized reads the same q with its own scale (and zero point) tables
        write_gather_tables(w, name, qw, wq, dtype)
    return wq


def _quant_record(quant: QuantConfig | None, layout: WeightLayout, quantized: dict[str, WeightQuant]) -> QuantRecord | None:
    """manifest.quant: the export's settings, the quantized weights' names and how each is stored."""
    if quant is None:
        return None
    return from_json(QuantRecord, {**quant.to_dict(), "layout": layout.name, "weights": sorted(quantized),
                                   "per_weight": {name: quantized[name].to_dict() for name in sorted(quantized)}}, "quant")


def _manifest(ckpt, spec: ModelSpec, target: str, dtype: str, max_seq: int, max_batch: int,
              graphs: dict[str, GraphRecord], tokenizer: dict, folder: Path) -> Manifest:
    src = Path(ckpt.source)
    return Manifest(
        format=FORMAT, format_version=FORMAT_VERSION, decodert_version=__version__,
        onnx_version=onnx.__version__, created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        source=SourceRecord(path=str(src.resolve()), kind="gguf" if src.suffix == ".gguf" else "hf"),
        model=from_json(ModelRecord, spec.to_dict(), "model"), target=target, dtype=dtype,
        max_seq=max_seq, max_batch=max_batch,
        kv=KVRecord(num_layers=len(spec.kv_layers), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype,
                    shape=("batch", spec.num_kv_heads, max_seq, spec.head_dim), inplace=True,
                    layer_kinds=spec.layer_kinds,
                    states=tuple(StateRecord(layer=st.layer, name=st.name, shape=("batch", *st.shape), dtype=st.dtype)
                                 for st in state_specs(spec))),
        graphs=graphs, weights=WeightsRecord(file=WEIGHTS, bytes=(folder / WEIGHTS).stat().st_size),
        tokenizer=from_json(TokenizerRecord, {"file": "tokenizer.json", **tokenizer}, "tokenizer"),
        files={p.name: file_record(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST},
    )
