"""``decodert export``: checkpoint -> prefill.onnx + decode.onnx + weights.bin + tokenizer + manifest
(+ embed.onnx with ``embeddings``: export/lowering/embed_graph.py).

Everything is written into a temporary sibling folder and swapped into place at the end
(export/artifact/destination.py), so an interrupted or failed export leaves the old artifact or none.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from decodert.errors import DecodertError
from decodert.export import phase_graphs
from decodert.export.artifact import destination
from decodert.export.checkpoints.checkpoint import is_experts, num_experts
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.artifact.lora_layout import LoraLayout, LoraRecord
from decodert.export.lora.merge import MergedCheckpoint
from decodert.artifact.peft import read_peft
from decodert.export.lowering.graph import build_graph
from decodert.export.lowering.embed_graph import EMBED_FILE, build_embed_graph, embed_contract, embed_problem
from decodert.export.checkpoints.embedding_config import embedding_rule, is_embedding_checkpoint
from decodert.export.lowering.io_contract import VERIFY_WIDTH, io_contract, verifies_rows
from decodert.export.quantize.quant import QuantConfig, WeightQuant, quantize, quantized_embedding, write_gather_tables
from decodert.export.quantize.quant_gguf import transcoded_as
from decodert.export.checkpoints.sampling_defaults import sampling_record
from decodert.export.lowering.targets import get_target
from decodert.export.quantize.weight_layouts import WeightLayout
from decodert.artifact.artifact_files import file_record
from decodert.artifact.cache_records import StateRecord
from decodert.artifact.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, EmbeddingRecord, GraphRecord, KVRecord,
                                        Manifest, ModelRecord, PluginsRecord, QuantRecord, SamplingRecord, SourceRecord,
                                        TokenizerRecord, WeightsRecord, from_json, write_manifest)
from decodert.export.progress import Stage
from decodert.export.audio_export import audio_of, write_audio
from decodert.export.seq2seq_export import export_seq2seq, is_encoder_decoder
from decodert.export.vision_export import vision_of, write_vision
from decodert.export.lowering.semantics import tokenizer_vocab
from decodert.artifact.weights import WeightsWriter
from decodert.models.spec import ModelSpec, rope_head_dim, rope_tables, state_specs
from decodert.models.canonical import canonical_names, canonical_shape
from decodert.models.audio import audio_dtype, audio_names, audio_shape
from decodert.models.vision import VisionSpec, vision_names, vision_shape
from decodert.plugins.ops.kv_dtypes import KVDtype
from decodert.plugins.ops.kv_dtypes import kv_dtype as kv_dtype_of
from decodert.plugins.selection import choose_plugins
from decodert.export.quantize import kv_calibrate
from decodert.artifact.version import __version__

DTYPES = ("fp32", "fp16", "bf16")
WEIGHTS = "weights.bin"


def export_model(src: str | Path, out_dir: str | Path, target: str = "ort", dtype: str = "fp32",
                 max_seq: int | None = None, max_batch: int = 4, progress: bool | None = None,
                 quant: QuantConfig | None = None, plugins: str = "auto", trt_version: str | None = None,
                 kv_dtype: str | None = None, lora: LoraLayout | None = None,
                 merge_lora: Sequence[str | Path] = (), embeddings: bool | None = None,
                 hidden_states: bool = False, openvino_prefill: bool = False,
                 hidden_layers: str | Sequence[int] | None = None) -> Manifest:
    """Export ``src`` (HF folder or .gguf) into ``out_dir``; returns the manifest.

    ``plugins`` (auto|always|never, trt target): emit decodert plugin nodes instead of native
    TensorRT layers (plugins/selection.py decides ``auto`` from ``trt_version`` or the installed TensorRT).

    ``quant`` stores the linear weights block-quantized (export/quantize/quant.py); the trt target needs
    symmetric quantization (TensorRT's int4 weights have no zero point) and gets it. GGUF Q4_0 /
    Q8_0 weights that match the config are transcoded exactly instead (the rule: export/quantize/quant.py);
    ``manifest.quant.per_weight`` records how each weight is stored.

    ``kv_dtype`` (fp32|fp16|bf16|int8|fp8|int4; None: ``dtype``) is the KV cache's element type
    (plugins/ops/kv_dtypes.py); a quantized cache's per-channel scales are calibrated here
    (export/quantize/kv_calibrate.py). ``manifest.kv_dtype`` records it.

    ``lora``: adapter slots the graphs take at run time (artifact/lora_layout.py); ``merge_lora``: PEFT
    adapter folders whose updates are added to the weights (export/lora/merge.py).

    ``embeddings`` also writes embed.onnx (the last hidden state of every position, no K/V) and the manifest's
    ``embedding`` record (its pooling rule: export/checkpoints/embedding_config.py); None: only for an embedding
    checkpoint (a sentence-transformers folder). Without it the artifact is what it was before, byte for byte.

    ``hidden_states``: the prefill, decode and verify graphs also return the last hidden state (what a draft
    head reads: export/lowering/io_contract.hidden_outputs); without it the graphs are byte for byte as before.
    ``hidden_layers`` ("eagle3": (2, N // 2, N - 3) of the N layers, or the layer indices): those outputs carry
    the inputs of these layers, concatenated (an EAGLE-3 head's features; implies ``hidden_states``); the
    manifest's ``hidden_layers`` records them.

    ``openvino_prefill`` (ort target) also writes the portable prefill graph the OpenVINO EP takes
    (export/phase_graphs.py, manifest ``phase_graphs``); off, the artifact is what it was before, byte for byte.
    """
    from decodert.export.heads import is_head_checkpoint

    if is_encoder_decoder(src):  # Whisper: its encoder and decoder graphs (export/seq2seq_export.py)
        return export_seq2seq(src, out_dir, target, dtype, max_batch, quant=quant, lora=lora,  # type: ignore[return-value]
                              merge_lora=tuple(merge_lora), embeddings=embeddings,
                              hidden_states=hidden_states or hidden_layers is not None,
                              openvino_prefill=openvino_prefill, kv_dtype=kv_dtype, max_seq=max_seq,
                              trt_version=trt_version)
    if is_head_checkpoint(src):
        raise DecodertError(f"{src} is a draft head checkpoint; export it beside its target: `decodert export {src} "
                            "--target-artifact TARGET -o OUT` (export/heads/)")
    tgt = get_target(target)
    _check_settings(dtype, max_seq, max_batch)
    _check_lora(tgt, lora)
    quant = tgt.quant_config(quant)  # TensorRT: symmetric; --keep-q4-1 only where the layout keeps block minimums
    out_dir = destination.prepare(out_dir)
    progress = True if progress is None else progress  # export/progress.py: a bar on a terminal, else lines
    ckpt, quant, max_seq = _open_source(src, tgt, quant, lora, merge_lora, max_seq, progress)
    spec: ModelSpec = ckpt.spec
    layers = feature_layers(hidden_layers, spec)
    hidden_states = hidden_states or bool(layers)
    plugin_record = choose_plugins(plugins, tgt, trt_version)
    plugin_ops = tuple(plugin_record["ops"]) if plugin_record else ()
    kv = kv_dtype_of(kv_dtype, dtype)
    tgt.make_lowering(spec, dtype, max_seq, plugins=plugin_ops, kv=kv)  # refuses a KV dtype the target cannot keep
    embeddings = _check_embeddings(embeddings, ckpt)
    if openvino_prefill:
        phase_graphs.check_openvino_prefill(target, kv, lora, quant)

    with destination.staging(out_dir) as tmp:  # SIGTERM / SIGHUP remove the temp folder as SIGINT does
        layout = tgt.weight_layout
        vision, audio = vision_of(ckpt), audio_of(ckpt)
        weights, quantized = _write_weights(ckpt, spec, tmp / WEIGHTS, dtype, max_seq, progress, quant, layout, vision,
                                            audio)
        vision_weights = {k: weights.pop(k) for k in [k for k in weights if k.startswith("vision.")]}
        audio_weights = {k: weights.pop(k) for k in [k for k in weights if k.startswith("audio.")]}
        lowering = tgt.make_lowering(spec, dtype, max_seq, quant, quantized, plugins=plugin_ops, kv=kv)
        with Stage("writing graphs and manifest", total=5, unit="step", enabled=progress) as bar:
            tokenizer = ckpt.write_tokenizer(tmp)
            if kv.quantized:  # per-channel scales from the float-cache graph over a built-in text
                weights = {**weights, **_kv_scales(spec, tgt.make_lowering(spec, dtype, max_seq, quant, quantized),
                                                   weights, kv, tmp)}
            graphs = _write_graphs(spec, lowering, weights, dtype, max_seq, tmp, bar, lora, hidden_states, layers)
            phases = None if not openvino_prefill else phase_graphs.write_portable_prefill(
                spec, dtype, max_seq, quant, weights, kv, tmp, WEIGHTS,
                lambda path, lay: _write_weights(ckpt, spec, path, dtype, max_seq, progress, quant, lay))
            vision_record = None if vision is None else write_vision(ckpt, vision, vision_weights, dtype, tmp,
                                                                     lowering.ir_version, type(lowering))
            audio_record = None if audio is None else write_audio(ckpt, audio, audio_weights, dtype, tmp,
                                                                  lowering.ir_version, type(lowering))
            tokenizer["vocab_size"] = tokenizer_vocab(tmp / "tokenizer.json", spec.vocab_size, ckpt.source)
            manifest = _manifest(ckpt, spec, target, dtype, kv, max_seq, max_batch, graphs, tokenizer, tmp)  # hashes
            if phases is not None:
                manifest = manifest.replace(phase_graphs=phases)
            bar.update()
            if embeddings:
                manifest = manifest.replace(embedding=_write_embedding(ckpt, spec, lowering, weights, dtype, tmp))
                manifest = manifest.replace(files=_file_records(tmp))
            manifest = manifest.replace(
                sampling=from_json(SamplingRecord, sampling_record(ckpt, tokenizer.get("chat_template")), "sampling"),
                plugins=None if plugin_record is None else from_json(PluginsRecord, plugin_record, "plugins"),
                quant=_quant_record(quant, layout, quantized), lora=_lora_record(lora, merge_lora), vision=vision_record,
                audio=audio_record, hidden_layers=layers or None)
            write_manifest(tmp, manifest)
            destination.swap_in(tmp, out_dir)
            bar.update()
        return manifest


def _open_source(src: str | Path, tgt: Any, quant: QuantConfig | None, lora: LoraLayout | None,
                 merge_lora: Sequence[str | Path], max_seq: int | None, progress: bool) -> tuple[Any, QuantConfig | None, int]:
    """The checkpoint the export reads (with ``merge_lora`` merged in), the quantization (a GPTQ / AWQ
    checkpoint keeps its own 4-bit blocks unless asked otherwise) and max_seq (default: up to 2048)."""
    with Stage(f"reading {Path(src).name}", enabled=progress):
        ckpt = open_checkpoint(src)
    spec: ModelSpec = ckpt.spec
    if quant is None:
        quant = tgt.quant_config(ckpt.native_quant())
    if lora is not None or merge_lora:  # adapters map onto dense attention and MLP weights only
        kinds = sorted({spec.layer_kind(i) for i in range(spec.num_layers)} - {"attention"})
        what = "mixture-of-experts" if any(spec.is_moe(i) for i in range(spec.num_layers)) else \
            f"hybrid ({', '.join(kinds)} layers)" if kinds else None
        if what:
            raise DecodertError(f"LoRA adapters (--lora-slots / --merge-lora) are not supported on a {what} model "
                                f"({spec.family}): they map onto dense q/k/v/o/gate/up/down weights only")
    if merge_lora:  # one fused model: the adapters' updates added to the weights as they are read
        ckpt = MergedCheckpoint(ckpt, [read_peft(d, spec) for d in merge_lora])
    max_seq = min(spec.max_position, 2048) if max_seq is None else max_seq
    if not 2 <= max_seq <= spec.max_position:
        raise DecodertError(f"--max-seq {max_seq} must be between 2 and the model's context length {spec.max_position}")
    return ckpt, quant, max_seq


def _check_embeddings(embeddings: bool | None, ckpt: Any) -> bool:
    """Whether embed.onnx is written (None: for an embedding checkpoint); refused in one line where it cannot be."""
    source = Path(ckpt.source)
    if embeddings is None:
        embeddings = source.is_dir() and is_embedding_checkpoint(source)
    if (getattr(ckpt, "config", None) or {}).get("use_bidirectional_attention") and not embeddings:
        raise DecodertError(f"{source}: use_bidirectional_attention=true is an embedding model (EmbeddingGemma): "
                            "export it with --embeddings (decodert's decoder graphs are causal; it does not generate)")
    problem = embed_problem(ckpt.spec) if embeddings else None
    if problem is not None:
        raise DecodertError(f"--embeddings: {problem}")
    return bool(embeddings)


def _write_embedding(ckpt: Any, spec: ModelSpec, lowering: Any, weights: dict, dtype: str, tmp: Path) -> EmbeddingRecord:
    """embed.onnx (checked) and its dense layers' files -> the manifest's ``embedding`` record."""
    source = Path(ckpt.source)
    rule = embedding_rule(source if source.is_dir() else None, getattr(ckpt, "config", None), spec.hidden_size, tmp)
    path = tmp / EMBED_FILE
    onnx.save_model(build_embed_graph(spec, lowering, weights, rule["causal"]), path)
    onnx.checker.check_model(str(path), full_check=True)
    return from_json(EmbeddingRecord, {"graph": {"file": EMBED_FILE, **embed_contract(spec)}, **rule}, "embedding")


def _check_lora(tgt: Any, lora: LoraLayout | None) -> None:
    """--lora-slots / --lora-rank: positive, and a target whose graphs take adapters."""
    if lora is not None:
        tgt.check_lora_slots(lora.slots)
        if lora.slots < 1 or lora.rank < 1:
            raise DecodertError(f"--lora-slots {lora.slots} and --lora-rank {lora.rank} must both be >= 1")


def _lora_record(lora: LoraLayout | None, merge_lora: Sequence[str | Path]) -> LoraRecord | None:
    """manifest.lora: the slots the graphs take and the adapters merged into the weights (None: neither)."""
    if lora is None and not merge_lora:
        return None
    return LoraRecord(slots=lora.slots if lora else 0, rank=lora.rank if lora else 0,
                      merged=tuple(str(Path(d).resolve()) for d in merge_lora))


def _check_settings(dtype: str, max_seq: int | None, max_batch: int) -> None:
    if dtype not in DTYPES:
        raise DecodertError(f"unknown dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    if max_batch < 1:
        raise DecodertError(f"--max-batch must be >= 1 (got {max_batch})")
    if max_seq is not None and (not isinstance(max_seq, int) or max_seq < 2):
        raise DecodertError(f"--max-seq must be an integer >= 2 (got {max_seq!r})")


def _write_graphs(spec: ModelSpec, lowering: Any, weights: dict, dtype: str, max_seq: int, tmp: Path,
                  bar: Stage, lora: LoraLayout | None = None, hidden: bool = False,
                  hidden_layers: tuple[int, ...] = ()) -> dict[str, GraphRecord]:
    """prefill.onnx, decode.onnx and verify.onnx (checked) -> their manifest records (``hidden``: with the
    hidden-state outputs a draft head reads; ``hidden_layers``: which layers' inputs they carry)."""
    graphs = {}
    for kind in ("prefill", "decode", "verify"):
        path = tmp / f"{kind}.onnx"
        onnx.save_model(build_graph(spec, lowering, weights, kind, lora, hidden, hidden_layers), path)
        onnx.checker.check_model(str(path), full_check=True)
        contract = {"file": path.name,
                    **io_contract(spec, dtype, max_seq, kind, verifies_rows(lowering, kind), lowering.kv, lora, hidden,
                                  hidden_layers)}
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


# tables written row by row (Checkpoint.rows): Gemma 4's per-layer embeddings are 2.35 B values in E2B
STREAMED_ROWS = ("embed_per_layer",)


def _write_weights(ckpt, spec: ModelSpec, path: Path, dtype: str, max_seq: int, progress: bool,
                   quant: QuantConfig | None, layout: WeightLayout,
                   vision: VisionSpec | None = None,
                   audio: Any = None) -> tuple[dict[str, onnx.TensorProto], dict[str, WeightQuant]]:
    """Stream every canonical tensor (one at a time) plus the RoPE tables into weights.bin.

    Returns the initializers and how each weight stored quantized is stored (by name).
    """
    quantized: dict[str, WeightQuant] = {}
    gather_quantized = quantized_embedding(spec, quant, layout)
    tied_head = spec.tie_word_embeddings and quant is not None and quant.lm_head
    with WeightsWriter(path) as w, _weights_stage(spec, dtype, quant, progress) as bar:
        for name in canonical_names(spec):
            tensor = None
            if is_experts(name):
                wq = _write_experts(w, ckpt, name, spec, quant, dtype, layout)
                if wq is not None:
                    quantized[name] = wq
            elif quant is not None and quant.applies_to(name):
                quantized[name] = _store_quantized(w, ckpt, name, name, quant, dtype, layout)
            elif name in STREAMED_ROWS:
                w.add_stacked(name, ckpt.rows(name), dtype, canonical_shape(spec, name))
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
            cos, sin = rope.cos_sin(rope_head_dim(spec, prefix), max_seq)
            w.add(f"{prefix}.cos", cos, dtype)
            w.add(f"{prefix}.sin", sin, dtype)
        for name in vision_names(vision) if vision is not None else ():  # vision.onnx's, in the graph dtype
            w.add(name, ckpt.vision_tensor(name, vision_shape(vision, name)), dtype)
        for name in audio_names(audio) if audio is not None else ():  # audio.onnx's, in the graph dtype
            w.add(name, ckpt.audio_tensor(name, audio_shape(audio, name)), audio_dtype(audio, name, dtype))
        w.close()
        return w.tensors, quantized


def _write_experts(w: WeightsWriter, ckpt, name: str, spec: ModelSpec, quant: QuantConfig | None, dtype: str,
                   layout: WeightLayout) -> WeightQuant | None:
    """A layer's experts [E, rows, in], read, converted (or quantized) and written one expert at a time:
    never the layer's experts in float32 at once (int4: the layer's quantized experts, 1/8 of that)."""
    shape = canonical_shape(spec, name)
    experts = (ckpt.expert(name, j) for j in range(num_experts(spec, name)))
    if quant is None or not quant.applies_to(name):
        w.add_stacked(name, experts, dtype, shape)
        return None
    if shape[2] % quant.block_size:
        raise DecodertError(f"--block-size {quant.block_size} must divide the experts' input width {shape[2]} "
                            f"('{name}'): quantized experts take whole blocks; choose a smaller --block-size")
    wq = quant.rtn()
    layout.write_stacked(w, name, [quantize(e, quant) for e in experts], wq, dtype)
    return wq


def _store_quantized(w: WeightsWriter, ckpt, src: str, name: str, quant: QuantConfig, dtype: str, layout: WeightLayout,
                     gather: bool = False, tensor: np.ndarray | None = None) -> WeightQuant:
    """Store canonical weight ``src`` quantized as ``name``: GPTQ / AWQ or GGUF blocks transcoded where that
    is exact (export/quantize/quant_packed.py, quant_gguf.py), else rounded to nearest from float (``tensor``,
    if already read)."""
    packed = None if gather else ckpt.packed(src)
    wq = transcoded_as(ckpt.block_type(src), quant, layout, gathered=gather)
    if packed is not None:
        qw, wq = packed
        if quant.symmetric and not wq.symmetric:
            raise DecodertError(f"{ckpt.source}: {src} is {wq.source} with zero points, which --symmetric / --target "
                                "trt (int4 without zero points) cannot keep exactly; export --target ort or portable")
    elif wq is not None:
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


def _kv_scales(spec: ModelSpec, float_cache: Any, weights: dict, kv: KVDtype, tmp: Path) -> dict[str, onnx.TensorProto]:
    """Calibrate a quantized cache's scales on ``float_cache`` (the same lowering with a float cache)."""
    path = tmp / "kv_calibration.onnx"  # beside weights.bin, whose tensors it references; removed after
    try:
        onnx.save_model(build_graph(spec, float_cache, weights, "prefill"), path)
        ids = kv_calibrate.calibration_ids(tmp / "tokenizer.json", float_cache.max_seq)
        scales = kv_calibrate.calibrate(path, spec, kv, float_cache.dtype, float_cache.max_seq, ids,
                                        float_cache.rotary_dim)
    finally:
        path.unlink(missing_ok=True)
    return kv_calibrate.scale_tensors(scales)


EAGLE3_FEATURES = "eagle3"  # hidden_layers: the layers EAGLE-3 heads read by default (models/families/eagle3.py)


def feature_layers(value: str | Sequence[int] | None, spec: ModelSpec) -> tuple[int, ...]:
    """``hidden_layers`` -> the layer indices ("eagle3": (2, N // 2, N - 3); a "2,15,27" string or ints); ()
    for None. One line where one is not a layer of the model."""
    if value is None:
        return ()
    n = spec.num_layers
    if value == EAGLE3_FEATURES:
        ids: tuple[int, ...] = (2, n // 2, n - 3)
    else:
        try:
            ids = tuple(int(i) for i in (value.split(",") if isinstance(value, str) else value))
        except (TypeError, ValueError):
            raise DecodertError(f"--hidden-layers must be 'eagle3' or layer indices like 2,15,27 (got {value!r})") from None
    if not ids or not all(0 <= i < n for i in ids):
        raise DecodertError(f"--hidden-layers {list(ids)}: layer indices of the model's {n} layers (0..{n - 1})")
    return ids


def _file_records(folder: Path) -> dict:
    """Every file the artifact holds (name -> size and sha256), but the manifest and the export's own marker."""
    return {p.name: file_record(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in (MANIFEST, destination.MARKER)}


def _manifest(ckpt, spec: ModelSpec, target: str, dtype: str, kv: KVDtype, max_seq: int, max_batch: int,
              graphs: dict[str, GraphRecord], tokenizer: dict, folder: Path) -> Manifest:
    src = Path(ckpt.source)
    return Manifest(
        format=FORMAT, format_version=FORMAT_VERSION, decodert_version=__version__,
        onnx_version=onnx.__version__, created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        source=SourceRecord(path=str(src.resolve()), kind="gguf" if src.suffix == ".gguf" else "hf"),
        model=from_json(ModelRecord, spec.to_dict(), "model"), target=target, dtype=dtype,
        max_seq=max_seq, max_batch=max_batch, kv_dtype=kv.name,
        kv=KVRecord(num_layers=len(spec.kv_layers), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                    head_dims=() if spec.uniform_head_dim else spec.head_dims,
                    dtype=kv.storage, shape=("batch", spec.num_kv_heads, max_seq, kv.width(spec.head_dim)),
                    inplace=True, scales="per_channel" if kv.quantized else None, layer_kinds=spec.layer_kinds,
                    states=tuple(StateRecord(layer=st.layer, name=st.name, shape=("batch", *st.shape), dtype=st.dtype)
                                 for st in state_specs(spec))),
        graphs=graphs, weights=WeightsRecord(file=WEIGHTS, bytes=(folder / WEIGHTS).stat().st_size),
        tokenizer=from_json(TokenizerRecord, {"file": "tokenizer.json", **tokenizer}, "tokenizer"),
        files=_file_records(folder),
    )
