"""ONNX artifact -> TensorRT engines: ``decodert build OUT``.

Reads OUT/manifest.json, parses OUT/prefill.onnx and OUT/decode.onnx from their paths (so the
shared external data ``weights.bin`` resolves), builds one strongly typed engine per graph with
one optimization profile sized from the manifest, writes OUT/{prefill,decode}.engine atomically
and records each engine in manifest.engines (docs/TENSORRT.md describes the record).

Profiles (B = max batch, S = max seq; KV inputs are [batch, H_kv, S_max, D], S_max static):
    prefill: batch 1 .. B (opt max(B // 2, 1)), seq 1 .. S (opt min(S, 256))
    decode:  batch 1 .. B (opt B),               seq 1
    vision:  images 1 .. the tiles of one image at the processor's largest size (opt: that many); its own
             engine OUT/vision.engine beside the others (vision-language artifacts: manifest.vision)
A vision-language prefill engine takes the graph's image inputs, and every engine of an M-RoPE model
rope_offsets (export/trt_graphs.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

from decodert.errors import DecodertError
from decodert.artifact.artifact_files import write_atomic
from decodert.artifact.seq2seq import is_seq2seq_artifact
from decodert.artifact.trt_engines import AUDIO, VISION, check_io, engine_io, graph_of, make_logger, trt_dtype_name
from decodert.export.artifact.destination import linked_copy, swap_in
from decodert.export.trt_graphs import audio_ranges, max_patches, max_tiles, profile_shapes, without_input_defaults
from decodert.artifact.targets import target_info
from decodert.export.trt_progress import make_progress
from decodert.artifact.manifest import MANIFEST, EngineRecord, GraphRecord, Manifest, from_json, load_manifest, write_manifest
from decodert.plugins.trt.compat import TrtInfo, load_trt

GRAPHS = ("prefill", "decode")
PRECISIONS = ("fp16", "bf16", "fp32")


# ---------------------------------------------------------------- small helpers
def read_manifest(out_dir: Path, verify: str = "fast") -> Manifest:
    """Load and validate OUT/manifest.json and verify its files ("fast": sizes + edge hashes, "full": sha256)."""
    manifest = load_manifest(out_dir, verify=verify)
    target = target_info(manifest.target)
    if not target.runs_on("trt"):
        raise DecodertError(f"{Path(out_dir) / MANIFEST}: the graphs were exported for --target {target.name} "
                            f"({target.about}); re-export with --target trt to build TensorRT engines")
    if manifest.lora_layout is not None:
        raise DecodertError(f"{Path(out_dir) / MANIFEST}: the graphs take LoRA adapter slots (--lora-slots), which "
                            "the TensorRT backend does not bind; re-export without --lora-slots (--merge-lora merges one)")
    return manifest


def staged(path: Path) -> Path:
    """Where a new ``path`` is written before it replaces the old one."""
    return path.with_name(f".{path.name}.new")


def network_layer_types(network: Any) -> Counter[str]:
    """Counter of LayerType names in a parsed network, e.g. {"KV_CACHE_UPDATE": 2, ...}."""
    return Counter(network.get_layer(i).type.name for i in range(network.num_layers))


def resolve_precision(manifest: Manifest, precision: str | None) -> str:
    return check_precision(manifest.dtype, precision)


def check_precision(dtype: str, precision: str | None) -> str:
    """The graphs' ``dtype`` when ``--fp16`` / ``--bf16`` (``precision``) agrees with it, else a one-line error."""
    if dtype not in PRECISIONS:
        raise DecodertError(f"manifest.json dtype '{dtype}' cannot be built; expected one of {PRECISIONS}")
    if precision is not None and precision != dtype:
        raise DecodertError(f"--{precision} does not match the exported dtype '{dtype}' (graphs are strongly "
                            f"typed); build with --{dtype} or re-export with --dtype {precision}")
    return str(dtype)


def resolve_limits(manifest: Manifest, max_batch: int | None, max_seq: int | None) -> tuple[int, int]:
    exported_seq = manifest.max_seq
    batch = int(max_batch or manifest.max_batch)
    seq = int(max_seq or exported_seq)
    if batch < 1:
        raise DecodertError(f"--max-batch must be >= 1 (got {batch})")
    if not 1 <= seq <= exported_seq:
        raise DecodertError(f"--max-seq {seq} must be between 1 and the exported max_seq {exported_seq} "
                            "(the KV cache length is static in the graphs; re-export with a larger --max-seq)")
    return batch, seq


# ---------------------------------------------------------------- parse
def parse_onnx(trt: ModuleType, builder: Any, logger: Any, path: Path) -> tuple[Any, Any]:
    """Parse ``path`` into a strongly typed network; DecodertError lists the parser's errors. A graph whose
    image inputs or rope_offsets have defaults is parsed without them (the engine takes those inputs)."""
    if not path.is_file():
        raise DecodertError(f"{path} not found (manifest.json names it)")
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    model = without_input_defaults(path)
    parsed = parser.parse(model, str(path)) if model is not None else parser.parse_from_file(str(path))
    if not parsed:
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        listed = "; ".join(f"node '{e.node_name()}' ({e.node_operator()}): {e.desc()}" for e in errors)
        raise DecodertError(f"{path}: TensorRT could not parse the graph: {listed or 'no error reported'}")
    return network, parser


def is_strongly_typed(trt: ModuleType, network: Any) -> bool:
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return flag is not None and bool(network.get_flag(flag))


def network_io(network: Any, graph: GraphRecord) -> dict[str, list[dict[str, Any]]]:
    """The network's I/O in manifest form; dynamic dims take the manifest's symbolic names."""
    symbolic = {name: t.shape for name, t in graph.io().items()}

    def entry(t: Any) -> dict[str, Any]:
        names: tuple[int | str, ...] = symbolic.get(t.name, ())
        dims = [names[i] if d < 0 and i < len(names) else int(d) for i, d in enumerate(t.shape)]
        return {"name": t.name, "dtype": trt_dtype_name(t.dtype), "shape": dims}

    return {"inputs": [entry(network.get_input(i)) for i in range(network.num_inputs)],
            "outputs": [entry(network.get_output(i)) for i in range(network.num_outputs)]}


# ---------------------------------------------------------------- build settings
def make_config(trt: ModuleType, info: TrtInfo, builder: Any, network: Any,
                shapes: dict[str, tuple[list[int], ...]], settings: dict[str, Any]) -> Any:
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name not in shapes:
            raise DecodertError(f"graph input '{name}' is not in manifest.json; re-export the artifact")
        profile.set_shape(name, *shapes[name])
    config.add_optimization_profile(profile)
    if settings["version_compatible"]:
        if not info.has_version_compatible:
            raise DecodertError(f"--version-compatible is not supported by {info.describe()}")
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if settings.get("timing_cache_obj") is not None:
        config.set_timing_cache(settings["timing_cache_obj"], False)
    if settings.get("monitor") is not None:
        config.progress_monitor = settings["monitor"]
    if settings.get("strip"):  # weights stay in weights.bin; the backend refits them from the ONNX at load
        config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)  # the refit brings the build's own weights back
    if settings.get("plugins"):  # decodert plugins write the KV cache in place (aliased plugin I/O)
        from decodert.plugins.trt.creators import enable_plugin_features

        enable_plugin_features(trt, config)
    return config


def target_record(trt: ModuleType, info: TrtInfo, config: Any) -> dict[str, Any]:
    """What the builder targets: compute capabilities (RTX AOT list or "any") and the hardware level."""
    rec: dict[str, Any] = {}
    if info.has_compute_capability:
        ccs = [config.get_compute_capability(i).name for i in range(config.num_compute_capabilities)]
        # RTX with no explicit target: portable across the supported GPUs, kernels JIT-compiled at load
        rec["compute_capability"] = ccs or "any"
    else:
        from decodert.plugins.cuda_mem import device_info, gpu_count

        rec["compute_capability"] = device_info()["compute_capability"] if gpu_count() else "unknown"
        rec["hardware_compatibility_level"] = config.hardware_compatibility_level.name
    return rec


def config_flags(trt: ModuleType, config: Any) -> list[str]:
    members = [m for m in dir(trt.BuilderFlag) if m.isupper()]
    return sorted(m for m in members if config.get_flag(getattr(trt.BuilderFlag, m)))


# ---------------------------------------------------------------- build
def _deserialized_io(trt: ModuleType, logger: Any, blob: bytes, graph: GraphRecord) -> dict[str, Any] | None:
    """Engine I/O read back from the plan when this machine can deserialize it (needs a GPU)."""
    from decodert.plugins.cuda_mem import gpu_count

    if gpu_count() == 0:
        return None
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    if engine is None:
        return None
    return {**engine_io(trt, engine, graph), "engine_layers": int(engine.num_layers)}


def build_one(trt: ModuleType, info: TrtInfo, out_dir: Path, name: str, manifest: Manifest,
              settings: dict[str, Any]) -> EngineRecord:
    """Parse, build and write OUT/<name>.engine; return its manifest record."""
    graph = graph_of(manifest, name)
    shapes = profile_shapes(graph, name, settings["max_batch"], settings["max_seq"], max_tiles(manifest),
                            max_patches(manifest), audio_ranges(manifest))
    return build_graph(trt, info, out_dir, name, graph, shapes, settings)


def build_graph(trt: ModuleType, info: TrtInfo, out_dir: Path, name: str, graph: GraphRecord,
                shapes: dict[str, tuple[list[int], ...]], settings: dict[str, Any]) -> EngineRecord:
    """Parse ``graph``, build it under the profile ``shapes`` and write OUT/<name>.engine (staged: ``build_engines``
    renames it) -> its EngineRecord."""
    logger = settings["logger"]
    builder = trt.Builder(logger)
    network, _parser = parse_onnx(trt, builder, logger, out_dir / graph.file)
    check_io(network_io(network, graph), graph, f"{graph.file} (parsed)")
    monitor = make_progress(trt, name, settings["progress"])  # a bar on a terminal, else a line every 10 s
    config = make_config(trt, info, builder, network, shapes, {**settings, "monitor": monitor})
    t0 = time.perf_counter()
    try:
        plan = builder.build_serialized_network(network, config)
    finally:
        if monitor is not None:
            monitor.close()
    seconds = time.perf_counter() - t0
    if plan is None:
        retry = "; or build self-contained engines with --self-contained" if settings.get("strip") else ""
        raise DecodertError(f"TensorRT failed to build {graph.file} (set DECODERT_TRT_VERBOSE=1 for the log){retry}")
    blob = bytes(plan)
    path = out_dir / f"{name}.engine"
    write_atomic(staged(path), blob)  # renamed into place by build_engines once every engine is built
    io = _deserialized_io(trt, logger, blob, graph)
    if io is not None:
        check_io(io, graph, path.name)  # extra keys (aliases, engine_layers) are ignored
    return from_json(EngineRecord, {
        "file": path.name, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
        "tensorrt": {"flavour": info.flavour, "version": info.version_str, "module": info.module_name},
        "precision": settings["precision"], "strongly_typed": is_strongly_typed(trt, network),
        "flags": config_flags(trt, config), "version_compatible": settings["version_compatible"],
        "max_batch": settings["max_batch"], "max_seq": settings["max_seq"],
        "profile": {k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in shapes.items()},
        "target": target_record(trt, info, config), "timing_cache": settings["timing_cache_note"],
        "layers": dict(sorted(network_layer_types(network).items())),
        "io": io or network_io(network, graph), "io_source": "engine" if io is not None else "network",
        "build_seconds": round(seconds, 3), "built": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "weights_stripped": bool(settings.get("strip")),
    }, f"engines.{name}")


def open_timing_cache(info: TrtInfo, trt: ModuleType, path: Path | None) -> tuple[Any, str]:
    """(ITimingCache or None, a note for the manifest)."""
    if path is None:
        return None, "none"
    if not info.has_timing_cache:
        return None, f"ignored: timing caches are a no-op in {info.describe()}"
    data = path.read_bytes() if path.is_file() else b""
    config = trt.Builder(make_logger(trt)).create_builder_config()
    cache = config.create_timing_cache(data)
    if cache is None:
        raise DecodertError(f"--timing-cache {path} could not be loaded (delete it to start a new one)")
    return cache, str(path)


def strip_problem(trt: ModuleType) -> str | None:
    """None when this TensorRT can build weight-stripped engines here, else why not (one clause)."""
    from decodert.plugins.cuda_mem import gpu_count

    missing = [n for n in ("STRIP_PLAN", "REFIT_IDENTICAL") if not hasattr(trt.BuilderFlag, n)]
    if missing or not hasattr(trt, "OnnxParserRefitter"):
        return f"this TensorRT has no {', '.join(missing) or 'OnnxParserRefitter'}"
    if gpu_count() == 0:  # measured with TensorRT-RTX 1.7: REFIT / STRIP_PLAN builds fail in Myelin's JIT without CUDA
        return "TensorRT builds refittable (weight-stripped) engines only with a GPU present"
    return None


def build_engines(out_dir: str | Path, precision: str | None = None, max_batch: int | None = None,
                  max_seq: int | None = None, version_compatible: bool = False,
                  timing_cache: str | Path | None = None, progress: bool = True, verify: str = "fast",
                  self_contained: bool = False) -> dict[str, EngineRecord]:
    """Build OUT/prefill.engine and OUT/decode.engine (and OUT/verify.engine when the artifact has a
    verify graph); update and return manifest.engines.

    Engines are weight-stripped where ``strip_problem`` allows (STRIP_PLAN + REFIT_IDENTICAL: the
    weights stay only in weights.bin and the backend refits each engine from its ONNX graph at
    load); ``self_contained`` (``--self-contained``) embeds them in every engine instead.
    ``EngineRecord.weights_stripped`` says which.
    The engines and the new manifest are written into a hard-linked copy of the folder that is swapped
    in whole (export/artifact/destination.py), so a build interrupted or killed at any point changes nothing;
    where hard links cannot be made, engines are renamed into place once all are built."""
    out = Path(out_dir)
    if is_seq2seq_artifact(out):
        raise DecodertError(f"{out} is an encoder-decoder artifact (seq2seq.json): export/trt_seq2seq.py "
                            "build_seq2seq_engines builds its engines (`decodert build` picks it)")
    manifest = read_manifest(out, verify)
    trt, info = load_trt(need_builder=True)
    if manifest.plugin_ops:  # decodert:: plugin nodes: the parser needs the creators
        from decodert.plugins.trt.creators import register_plugins

        register_plugins(trt, info)
    batch, seq = resolve_limits(manifest, max_batch, max_seq)
    cache_path = Path(timing_cache) if timing_cache else None
    cache, note = open_timing_cache(info, trt, cache_path)
    settings = {"precision": resolve_precision(manifest, precision), "max_batch": batch, "max_seq": seq,
                "version_compatible": version_compatible, "timing_cache_obj": cache, "timing_cache_note": note,
                "progress": progress, "logger": make_logger(trt),
                "plugins": bool(manifest.plugin_ops), "strip": not self_contained and strip_problem(trt) is None}
    staging = linked_copy(out)  # hard links to the artifact, swapped in whole at the end (None: in place)
    work = staging or out
    try:
        names = [n for n in (*GRAPHS, "verify") if n in manifest.graphs]  # older artifacts have no verify graph
        names += [VISION] if manifest.vision is not None else []
        names += [AUDIO] if manifest.audio is not None else []  # audio.engine (runtime/backends/trt/vision.py runs it)
        engines = {name: build_one(trt, info, work, name, manifest, settings) for name in names}
        for rec in engines.values():
            os.replace(staged(work / rec.file), work / rec.file)
        write_manifest(work, manifest.replace(engines=engines))
        if staging is not None:
            swap_in(staging, out.resolve())
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for name in (*GRAPHS, "verify", VISION, AUDIO):
            staged(work / f"{name}.engine").unlink(missing_ok=True)
    if cache is not None and cache_path is not None:
        write_atomic(cache_path, bytes(cache.serialize()))
    return engines
