"""manifest.json: the artifact's contract (model, graph I/O, files and their hashes), as typed records.

This module is the only one that reads, validates or writes manifest.json; everything else gets a
:class:`Manifest` and uses attributes. Written last, atomically, so a folder with a manifest is a
complete artifact. Loading checks the schema version, every field's type (``records.py``), the
ranges and the graph contract below, and (by default, cheaply) the files it names.

Adding a field: one line in the record class, with a default (``sampling: SamplingRecord | None =
None``) so that artifacts written before it still load; the type is checked on read and the
value written back by ``to_json``. Bump ``FORMAT_VERSION`` only when an old reader must refuse
the new files (a field changing meaning); ``load_manifest`` then names the versions it reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from decodert.errors import DecodertError
from decodert.artifact.artifact_files import FileRecord, verify_files
from decodert.artifact.graph_contract import check_contract, check_verify, need
from decodert.artifact.cache_records import KVRecord
from decodert.artifact.records import OMIT_NULL, R, Record, read_record, to_json
from decodert.artifact.lora_layout import LoraLayout, LoraRecord
from decodert.models.spec import ModelSpec
from decodert.models.spec_v1 import upgrade_model
from decodert.plugins.ops.kv_dtypes import KV_DTYPES

FORMAT = "decodert-artifact"
FORMAT_VERSION = 1  # the schema version this decodert writes
READS = (1,)  # schema versions this decodert reads
# The generation parameters a manifest's sampling.defaults may set (a subset of runtime/decoding/sampling.py's SamplingParams).
KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MANIFEST = "manifest.json"
VERIFY_MODES = ("fast", "full", "none")
GRAPHS = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class TensorInfo(Record):
    name: str
    dtype: str  # "fp32", "fp16", "bf16", "int64", ...
    shape: tuple[int | str, ...]  # str = a symbolic dim ("batch", "seq")


@dataclasses.dataclass(frozen=True)
class GraphRecord(Record):
    file: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...] = ()
    max_tokens: int | None = None  # verify graph: tokens per row and call (the TensorRT profile's seq max)
    batched_past: bool = False  # verify graph: one call may hold several rows over non-empty caches

    def io(self) -> dict[str, TensorInfo]:
        """name -> TensorInfo of every input and output."""
        return {t.name: t for t in self.inputs + self.outputs}

    @property
    def verifies_rows(self) -> bool:
        """prefill graph: it also runs one-row verify passes (input ``per_position``; export/lowering/graph.py)."""
        return any(t.name == "per_position" for t in self.inputs)


@dataclasses.dataclass(frozen=True)
class PhaseGraphRecord(Record):
    """A second graph for one phase, lowered for another backend than the target's (``decodert export
    --openvino-prefill``: the portable prefill beside an ort artifact's, which the OpenVINO EP takes whole).
    Same I/O contract as ``graphs[phase]`` minus what only the target's graph has (``per_position``:
    verify rows stay on the target's graph); runtime/backends/placement.py chooses between them by measurement."""
    phase: str  # "prefill"
    lowering: str  # the target whose lowering wrote it: "portable"
    graph: GraphRecord
    weights: str  # the weights file its initializers are in (weights.file when it shares the target's)


@dataclasses.dataclass(frozen=True)
class ImagesRecord(Record):
    """The spec's image tokens (models/spec.py ``ImageTokens``): prefill takes image embeddings at their rows."""
    token_id: int
    deepstack_layers: int = 0
    bidirectional: bool = False
    per_layer_token: int | None = dataclasses.field(default=None, metadata=OMIT_NULL)  # Gemma 4's audio rows


@dataclasses.dataclass(frozen=True)
class MRopeRecord(Record):
    section: tuple[int, ...]
    interleaved: bool = False


@dataclasses.dataclass(frozen=True)
class ModelRecord(Record):
    """The model spec (models/spec.py ``ModelSpec.to_dict()``); the fields below are typed, the rest (the layers by
    kind) kept in ``extra``. A format-1 spec (one flat dict) is converted when the manifest is read."""
    vocab_size: int
    family: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    images: ImagesRecord | None = None  # vision-language models
    mrope: MRopeRecord | None = None  # M-RoPE models: every graph takes rope_offsets

    def spec(self) -> ModelSpec:
        """The whole ModelSpec the artifact was exported from (its fields beyond these are in ``extra``)."""
        return ModelSpec.from_dict(to_json(self))

    @property
    def experts(self) -> tuple[int, int]:
        """(experts, experts per token) of the first MoE layer; (0, 0) without experts."""
        mlps = self.extra.get("mlps")
        moe = next((m for m in mlps if isinstance(m, Mapping) and m.get("kind") == "moe"), None) \
            if isinstance(mlps, (list, tuple)) else None
        return (int(moe.get("num_experts") or 0), int(moe.get("experts_per_token") or 0)) if moe else (0, 0)


@dataclasses.dataclass(frozen=True)
class WeightsRecord(Record):
    file: str
    bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class TokenizerRecord(Record):
    file: str = "tokenizer.json"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    vocab_size: int | None = None  # tokens the tokenizer knows (at most the model's vocab_size)


@dataclasses.dataclass(frozen=True)
class SourceRecord(Record):
    path: str | None = None
    kind: str | None = None  # "hf" | "gguf"


@dataclasses.dataclass(frozen=True)
class PluginsRecord(Record):
    mode: str = "auto"  # --plugins
    ops: tuple[str, ...] = ()  # decodert ops the graphs contain as plugin nodes
    tensorrt: str | None = None  # the TensorRT the choice was made for
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class WeightQuantRecord(Record):
    bits: int
    block_size: int
    symmetric: bool
    source: str  # "rtn" (rounded here) | "transcoded" (GGUF blocks kept exactly)
    block_min: bool = False  # Q4_1 kept exactly: a per-block minimum term
    act_order: bool = False  # GPTQ act-order: a g_idx (ort) or an input permutation (qdq) beside the blocks


@dataclasses.dataclass(frozen=True)
class QuantRecord(Record):
    """The export's QuantConfig (its fields, in ``extra`` beyond these), the layout and each weight's storage."""
    bits: int
    block_size: int
    layout: str  # "qdq" | "nbits" (the target's weight layout: export/quantize/weight_layouts.py)
    symmetric: bool = False
    accuracy_level: int = 0
    lm_head: bool = True
    keep_q8: bool = False
    keep_q4_1: bool = False
    scale_search: bool = True
    weights: tuple[str, ...] = ()
    per_weight: Mapping[str, WeightQuantRecord] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SamplingRecord(Record):
    """The model's recommended sampling settings (found at export: export/checkpoints/sampling_defaults.py)."""
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams field -> value (sampling_problem)
    source: str | None = None  # where they come from


@dataclasses.dataclass(frozen=True)
class VisionRecord(Record):
    """A vision-language model's image path: vision.onnx (graph), its tower (models/vision.py VisionSpec
    fields) and the checkpoint's image processor settings (runtime/vision/preprocess.py reads them)."""
    graph: GraphRecord
    spec: Mapping[str, Any]
    processor: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class AudioRecord(Record):
    """An audio-language model's audio path: audio.onnx (graph), its encoder (models/audio.py AudioSpec fields)
    and the checkpoint's log-mel settings (runtime/audio/features.py MelSettings fields); ``transcription`` the
    family's transcription request when it is not Qwen3-ASR's (runtime/audio/transcribe.py)."""
    graph: GraphRecord
    spec: Mapping[str, Any]
    features: Mapping[str, Any]
    transcription: Mapping[str, Any] | None = dataclasses.field(default=None, metadata=OMIT_NULL)


POOLING = ("last", "mean", "cls")  # the rules runtime/embedding.py applies


@dataclasses.dataclass(frozen=True)
class DenseRecord(Record):
    """One projection after pooling (sentence-transformers' Dense module): y = x @ weight^T + bias, stored
    float32 in ``file`` (an .npz in the artifact folder: ``weight`` [out, in], ``bias`` [out] if any)."""
    file: str
    in_features: int
    out_features: int
    bias: bool = False


@dataclasses.dataclass(frozen=True)
class EmbeddingRecord(Record):
    """embed.onnx (``decodert export --embeddings``, or an embedding checkpoint): the last hidden state of every
    position, and how the runtime turns it into one vector per input (runtime/embedding.py; docs/SERVING.md)."""
    graph: GraphRecord
    pooling: str  # "last" (the last valid token) | "mean" (over valid tokens) | "cls" (the first token)
    causal: bool = True  # False: every token attends to every valid token (EmbeddingGemma)
    dimensions: int | None = None  # the vector's size (the last dense layer's out_features, else hidden_size)
    matryoshka: bool = False  # trained for truncation: ``dimensions`` < the full size allowed (then renormalised)
    dense: tuple[DenseRecord, ...] = ()  # projections after pooling, in order
    source: str | None = None  # where the rule was read ("1_Pooling/config.json", "default: causal LM")


@dataclasses.dataclass(frozen=True)
class EngineRecord(Record):
    """One TensorRT engine written by ``decodert build`` (docs/TENSORRT.md lists the other keys)."""
    file: str
    size: int
    sha256: str
    tensorrt: Mapping[str, str] = dataclasses.field(default_factory=dict)  # flavour, version, module
    precision: str | None = None
    strongly_typed: bool | None = None
    version_compatible: bool = False
    max_batch: int | None = None
    max_seq: int | None = None
    profile: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # input -> {"min", "opt", "max"} dims
    target: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # compute capability, hardware level
    timing_cache: str | None = None
    layers: Mapping[str, int] = dataclasses.field(default_factory=dict)  # TensorRT layer type -> count
    io: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # {"inputs": [...], "outputs": [...]} as built
    build_seconds: float | None = None
    weights_stripped: bool = False  # STRIP_PLAN: the backend refits the weights from the ONNX graph at load


@dataclasses.dataclass(frozen=True)
class Manifest(Record):
    format: str
    format_version: int
    model: ModelRecord
    target: str  # "ort" | "trt" | "portable"
    dtype: str  # activations and KV cache: "fp32" | "fp16" | "bf16"
    max_seq: int
    max_batch: int
    kv: KVRecord
    graphs: Mapping[str, GraphRecord]
    weights: WeightsRecord
    tokenizer: TokenizerRecord
    files: Mapping[str, FileRecord]
    decodert_version: str | None = None
    onnx_version: str | None = None
    created: str | None = None
    source: SourceRecord | None = None
    plugins: PluginsRecord | None = None
    quant: QuantRecord | None = None
    sampling: SamplingRecord | None = None
    engines: Mapping[str, EngineRecord] | None = None
    vision: VisionRecord | None = None  # vision-language models: vision.onnx and the image processor
    kv_dtype: str | None = None  # --kv-dtype (None: older artifacts, the cache in ``dtype``)
    lora: LoraRecord | None = None
    embedding: EmbeddingRecord | None = dataclasses.field(default=None, metadata=OMIT_NULL)  # embed.onnx, when exported
    audio: AudioRecord | None = dataclasses.field(default=None, metadata=OMIT_NULL)  # audio.onnx and its log-mel settings
    # per-phase graphs for other backends, by name ("prefill.portable"); None: none (older exports, the option off)
    phase_graphs: Mapping[str, PhaseGraphRecord] | None = dataclasses.field(default=None, metadata=OMIT_NULL)
    # the layers whose inputs (concatenated) the hidden-state outputs carry, for an EAGLE-3 head (--hidden-layers);
    # None: those outputs (if any) are the final norm's output
    hidden_layers: tuple[int, ...] | None = dataclasses.field(default=None, metadata=OMIT_NULL)

    @property
    def lora_layout(self) -> LoraLayout | None:
        """The adapter slots the graphs take (None: none)."""
        return self.lora.layout if self.lora is not None else None

    def graph(self, kind: str) -> GraphRecord:
        return self.graphs[kind]

    @property
    def plugin_ops(self) -> tuple[str, ...]:
        """The decodert plugin ops in the graphs (none unless exported with --plugins)."""
        return self.plugins.ops if self.plugins is not None else ()


# ---------------------------------------------------------------- read / write
def from_json(cls: type[R], value: Any, where: str) -> R:
    """A record from JSON-like values (what the exporter assembles); DecodertError names the field."""
    return read_record(cls, value, where)


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Validate, then atomically write ``folder/manifest.json`` (temp file + fsync + rename)."""
    path = Path(folder) / MANIFEST
    validate(manifest, path)
    tmp = path.with_name(f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(to_json(manifest), indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_manifest(folder: Path | str, verify: str = "fast") -> Manifest:
    """Read and validate ``folder/manifest.json``; verify files: "none" | "fast" | "full"."""
    if verify not in VERIFY_MODES:
        raise DecodertError(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise DecodertError(f"{folder}: not a folder (expected an artifact made by 'decodert export')")
    if not path.is_file():
        raise DecodertError(f"{path}: missing; {folder} is not a decodert artifact (run 'decodert export' first)")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise DecodertError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    except OSError as e:
        raise DecodertError(f"{path}: cannot read ({e.strerror})") from None
    manifest = parse_manifest(raw, path)
    if verify != "none":
        verify_files(folder, manifest.files, full=verify == "full")
    return manifest


def parse_manifest(raw: Any, path: Path) -> Manifest:
    """Parsed JSON -> a validated Manifest; DecodertError names the file and the field."""
    _check_version(raw, path)
    if isinstance(raw.get("model"), dict):  # an artifact exported before the layers were declared by kind
        raw = {**raw, "model": upgrade_model(raw["model"])}
    try:
        m = read_record(Manifest, raw, "manifest")
    except DecodertError as e:
        raise DecodertError(f"{path}: {str(e).removeprefix('manifest.')}") from None
    validate(m, path)
    return m


def _check_version(raw: Any, path: Path) -> None:
    if not isinstance(raw, dict):
        raise DecodertError(f"{path}: expected a JSON object")
    fmt, version = raw.get("format"), raw.get("format_version")
    if fmt != FORMAT:
        raise DecodertError(f"{path}: format {fmt!r} is not {FORMAT!r}; not a decodert artifact")
    if type(version) is not int:
        raise DecodertError(f"{path}: format_version is missing or not an integer; re-export with 'decodert export'")
    if version > max(READS):
        raise DecodertError(f"{path}: schema v{version} was written by a newer decodert (this one reads "
                            f"v{', v'.join(map(str, READS))}); upgrade decodert or re-export with this one")
    if version not in READS:
        raise DecodertError(f"{path}: schema v{version} is too old for this decodert (reads "
                            f"v{', v'.join(map(str, READS))}); re-export the model with 'decodert export'")


# ---------------------------------------------------------------- validation (beyond the types)
def validate(m: Manifest, path: Path) -> None:
    """Ranges, file names and the graph contract; DecodertError names the field."""
    for name, rec in m.files.items():
        need(safe_name(name), path, f"file entry {name!r} points outside the artifact folder")
        need(rec.size >= 0 and _hex(rec.sha256) and (rec.edge_sha256 is None or _hex(rec.edge_sha256)), path,
              f"files.{name} is malformed")
    need(m.max_seq >= 2 and m.max_batch >= 1, path, "max_seq and max_batch must be integers >= 2 / >= 1")
    need(m.model.vocab_size >= 1, path, "model.vocab_size must be a positive integer")
    need(_ids(m.model.eos_token_ids) and _ids([m.model.bos_token_id]), path,
          "model.eos_token_ids / model.bos_token_id are malformed")
    kv = m.kv
    need(min(kv.num_layers, kv.num_kv_heads, kv.head_dim) >= 1, path,
          "kv.num_layers, kv.num_kv_heads and kv.head_dim must be positive integers")
    need(not kv.head_dims or (len(kv.head_dims) == kv.num_layers and min(kv.head_dims) >= 1), path,
          "kv.head_dims must give a positive head_dim for each of kv.num_layers layers")
    need(not kv.layer_kinds or sum(k == "attention" for k in kv.layer_kinds) == kv.num_layers, path,
          "kv.layer_kinds does not match kv.num_layers attention layers")  # (kv.layers would build a huge range)
    for st in kv.states:
        need(0 <= st.layer < max(len(kv.layer_kinds), 1) and st.name in ("conv", "recurrent") and len(st.shape) >= 2
              and st.dtype in (None, "fp32")
              and st.shape[0] == "batch" and all(type(d) is int and d >= 1 for d in st.shape[1:]), path,
              f"kv.states entry for layer {st.layer} ({st.name}) is malformed")
    kvd = KV_DTYPES.get(m.kv_dtype or m.dtype)
    need(kvd is not None and kv.dtype in (None, kvd.storage), path,
          f"kv_dtype {m.kv_dtype!r} / kv.dtype {kv.dtype!r} is not a KV cache type decodert knows")
    need(m.lora is None or (m.lora.slots >= 0 and (m.lora.rank >= 1) == (m.lora.slots >= 1)), path,
          "lora.slots / lora.rank are malformed")
    for kind in GRAPHS:
        need(kind in m.graphs, path, f"graphs.{kind} is missing or malformed")
        _listed(m, m.graphs[kind].file, path, f"graphs.{kind}.file")
    check_contract(m, path, GRAPHS)
    if m.vision is not None:
        _listed(m, m.vision.graph.file, path, "vision.graph.file")
        need(m.model.images is not None, path, "vision needs model.images (the image token)")
    if m.audio is not None:
        _listed(m, m.audio.graph.file, path, "audio.graph.file")
        need(m.model.images is not None, path, "audio needs model.images (the audio token whose rows it fills)")
    if "verify" in m.graphs:
        _listed(m, m.graphs["verify"].file, path, "graphs.verify.file")
    if m.embedding is not None:
        _check_embedding(m, path)
    for name, pg in (m.phase_graphs or {}).items():
        need(pg.phase in m.graphs and name == f"{pg.phase}.{pg.lowering}", path,
             f"phase_graphs.{name} must be named <phase>.<lowering> after one of graphs")
        _listed(m, pg.graph.file, path, f"phase_graphs.{name}.graph.file")
        _listed(m, pg.weights, path, f"phase_graphs.{name}.weights")
        target = {t.name: t for t in m.graphs[pg.phase].inputs + m.graphs[pg.phase].outputs}
        need(all(target.get(t.name) == t for t in pg.graph.inputs + pg.graph.outputs), path,
             f"phase_graphs.{name}: its inputs/outputs must be those of graphs.{pg.phase}")
    check_verify(m, path)
    _listed(m, m.weights.file, path, "weights.file")
    # listed in files is checked where it is opened (tokenizer_file): `decodert build` needs no tokenizer
    tok = m.tokenizer
    need(safe_name(tok.file), path, "tokenizer.file is not a file name in the artifact folder")
    need(_ids(tok.eos_token_ids) and _ids([tok.bos_token_id, tok.pad_token_id]) and (tok.vocab_size or 1) >= 1, path,
          "tokenizer token ids / add_bos_token / chat_template / vocab_size are malformed")
    if m.sampling is not None:
        problem = sampling_problem(to_json(m.sampling))
        need(problem is None, path, str(problem))
    for name, eng in (m.engines or {}).items():
        need(safe_name(eng.file) and eng.size >= 0 and _hex(eng.sha256), path, f"engines.{name} is malformed")


def _check_embedding(m: Manifest, path: Path) -> None:
    """embed.onnx listed, a known pooling rule, dense layers that chain from hidden_size to ``dimensions``."""
    e = m.embedding
    assert e is not None
    _listed(m, e.graph.file, path, "embedding.graph.file")
    need(e.pooling in POOLING, path, f"embedding.pooling {e.pooling!r} is not one of {', '.join(POOLING)}")
    width = m.model.hidden_size
    for i, d in enumerate(e.dense):
        _listed(m, d.file, path, f"embedding.dense[{i}].file")
        need(width is None or d.in_features == width, path,
             f"embedding.dense[{i}].in_features {d.in_features} does not follow the width {width} before it")
        width = d.out_features
    need(e.dimensions is not None and e.dimensions >= 1 and (width is None or e.dimensions == width), path,
         f"embedding.dimensions {e.dimensions} is not the vector's size {width}")


def sampling_problem(record: Any) -> str | None:
    """None when ``record`` is a well-formed manifest["sampling"], else what is wrong."""
    if not isinstance(record, dict) or not isinstance(record.get("defaults"), dict):
        return "sampling must be an object with a 'defaults' object"
    for k, v in record["defaults"].items():
        if k not in KNOBS:
            return f"sampling.defaults.{k} is not a generation parameter ({', '.join(KNOBS)})"
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return f"sampling.defaults.{k} must be a finite number"
    return None


def safe_name(name: Any) -> bool:
    """A plain file name inside the artifact folder: no folders, no '..', not absolute, no NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and Path(name).name == name


def tokenizer_file(m: Manifest, folder: Path) -> Path:
    """The tokenizer file a runtime opens: it must be listed in ``files`` (so it was verified)."""
    _listed(m, m.tokenizer.file, folder / MANIFEST, "tokenizer.file")
    return folder / m.tokenizer.file


def _ids(values: Any) -> bool:
    return all(v is None or v >= 0 for v in values)


def _hex(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _listed(m: Manifest, name: str, path: Path, what: str) -> None:
    """A file the loaders open must be a plain name that ``files`` lists (so it is verified)."""
    need(safe_name(name), path, f"{what} {name!r} is not a file name inside the artifact folder")
    need(name in m.files, path, f"{what} {name!r} is not listed in 'files' (it could not be verified)")
