"""A CPU stand-in for CUDA and a TensorRT runtime, so runtime/backends/trt/backend.py runs in tests on a machine
without a GPU (no GPU is lent to CI; the backend's logic is otherwise never executed).

What is emulated, and what it checks:

- **CUDA** (plugins/cuda_mem.py): tests/helpers/cuda_emulator.py, bounds-checked memory, streams, graphs.
- **TensorRT**: an engine file written by ``emulate_engines`` names the artifact's ONNX graph and the
  build profile (export/trt_graphs.py ``profile_shapes``, as ``decodert build`` uses). Its execution
  context checks that an input shape lies in the profile (``set_input_shape`` returns False
  outside, as TensorRT does), that scratch memory and every I/O address were set, reads the inputs
  from their addresses, runs the graph with ONNX Runtime and writes each output at its address:
  ``present_*`` over ``past_*`` in place.

Not emulated: kernels (the numbers are ONNX Runtime's), timing, asynchrony between the host and the
device (a missing stream sync is not caught), TensorRT-RTX's JIT and runtime cache.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulator import Device, EmulatorError  # noqa: E402

from decodert.artifact.manifest import EngineRecord, load_manifest, write_manifest  # noqa: E402
from decodert.artifact.trt_engines import AUDIO, VISION, graph_of  # noqa: E402
from decodert.export.trt_graphs import audio_ranges, max_patches, max_tiles, profile_shapes  # noqa: E402

__all__ = ["Device", "EmulatorError", "EmulatedTensorRT", "emulate_engines", "emulate_seq2seq_engines", "install"]

VERSION = "1.7.1.116"  # what the emulated engines say built them (a TensorRT-RTX version)
_TRT_DTYPES = {onnx.TensorProto.FLOAT: "FLOAT", onnx.TensorProto.FLOAT16: "HALF", onnx.TensorProto.BFLOAT16: "BF16",
               onnx.TensorProto.INT64: "INT64", onnx.TensorProto.INT32: "INT32", onnx.TensorProto.BOOL: "BOOL"}
MAGIC = "decodert-emulated-engine"


# ---------------------------------------------------------------- TensorRT
class _DType:
    def __init__(self, name: str) -> None:
        self.name = name


class Engine:
    """An emulated engine: the ONNX graph the blob names, its I/O and its build profile."""

    def __init__(self, trt: "EmulatedTensorRT", blob: dict[str, Any]) -> None:
        self.trt, self.path = trt, Path(blob["graph"])
        self.profile: dict[str, dict[str, list[int]]] = blob["profile"]
        model = onnx.load(str(self.path), load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        self.io: dict[str, tuple[bool, str, tuple[int, ...]]] = {}  # name -> (is input, TRT dtype, dims (-1 dynamic))
        self.np_dtypes: dict[str, np.dtype] = {}  # name -> what its bytes hold
        for is_input, values in ((True, model.graph.input), (False, model.graph.output)):
            for v in values:
                if v.name in inits and v.name not in self.profile:
                    continue  # an overridable initializer the build folded, not an engine input
                t = v.type.tensor_type
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
                self.io[v.name] = (is_input, _TRT_DTYPES[t.elem_type], dims)
                self.np_dtypes[v.name] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
        self.names = list(self.io)
        self.num_io_tensors = len(self.names)
        self.device_memory_size_v2 = int(blob.get("scratch", 1 << 12))
        self.num_layers = 1

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.io[name][2]

    def get_tensor_dtype(self, name: str) -> _DType:
        return _DType(self.io[name][1])

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if self.io[name][0] else "OUTPUT"

    def get_aliased_input_tensor(self, name: str) -> str | None:
        alias = "past_" + name[len("present_"):] if name.startswith("present_") else None
        return alias if alias in self.io else None

    def create_execution_context(self, strategy: Any = None) -> "Context":
        return Context(self)

    def session(self) -> ort.InferenceSession:
        return self.trt.session(self.path)


class Context:
    """An execution context: addresses and input shapes set by the backend, run on ``execute_async_v3``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.scratch: tuple[int, int] | None = None

    def set_device_memory(self, ptr: int, nbytes: int) -> None:
        if nbytes < self.engine.device_memory_size_v2:
            raise EmulatorError(f"scratch of {nbytes} bytes < the engine's {self.engine.device_memory_size_v2}")
        self.engine.trt.device.mem.view(ptr, nbytes, "device", "scratch memory")
        self.scratch = (ptr, nbytes)

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if name not in self.engine.io:
            return False
        self.addresses[name] = ptr
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        io = self.engine.io.get(name)
        if io is None or not io[0] or len(shape) != len(io[2]):
            return False
        lo, hi = self.engine.profile[name]["min"], self.engine.profile[name]["max"]
        if any(not a <= d <= b for d, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(int(d) for d in shape)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        eng = self.engine
        if self.scratch is None:
            raise EmulatorError("execute without scratch memory (USER_MANAGED contexts need set_device_memory)")
        missing = [n for n in eng.names if n not in self.addresses] + [n for n, io in eng.io.items()
                                                                       if io[0] and n not in self.shapes]
        if missing:
            raise EmulatorError(f"execute with no address or shape for {missing[:3]}")
        addresses, shapes = dict(self.addresses), dict(self.shapes)  # what a capture bakes in
        eng.trt.device.enqueue(stream_handle, lambda: self._run(addresses, shapes))
        return True

    def _run(self, addresses: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> None:
        eng, mem = self.engine, self.engine.trt.device.mem
        session = eng.session()
        feeds = {}
        for name, shape in shapes.items():
            dtype = eng.np_dtypes[name]
            n = int(np.prod(shape)) * dtype.itemsize
            feeds[name] = mem.view(addresses[name], n, "device", f"input {name}").view(dtype).reshape(shape).copy()
        outs = session.run(None, feeds)
        for meta, value in zip(session.get_outputs(), outs):
            if meta.name not in addresses:
                continue
            value = np.ascontiguousarray(value)
            alias = eng.get_aliased_input_tensor(meta.name)
            if alias is not None and addresses[meta.name] != addresses[alias]:
                raise EmulatorError(f"{meta.name} is not bound at its past tensor's address (in-place cache)")
            mem.view(addresses[meta.name], value.nbytes, "device", f"output {meta.name}")[:] = value.view(np.uint8).reshape(-1)
        eng.trt.device.counts["engine_runs"] += 1


class EmulatedTensorRT:
    """What ``load_trt()`` returns in the emulator: (module, TrtInfo)."""

    def __init__(self, device: Device) -> None:
        from decodert.plugins.trt.compat import TrtInfo

        self.device = device
        self._sessions: dict[Path, ort.InferenceSession] = {}
        self.deserialized: list[str] = []  # graph file names, in order
        trt = self

        class Runtime:
            def __init__(self, logger: Any) -> None:
                pass

            def deserialize_cuda_engine(self, blob: bytes) -> Engine | None:
                data = json.loads(bytes(blob).decode())
                if data.get("magic") != MAGIC:
                    return None
                trt.deserialized.append(Path(data["graph"]).name)
                return Engine(trt, data)

        class Logger:
            INFO, ERROR = 1, 3

            def __init__(self, level: int) -> None:
                self.level = level

        self.module = types.SimpleNamespace(
            __version__=VERSION, Runtime=Runtime, Logger=Logger,
            ExecutionContextAllocationStrategy=types.SimpleNamespace(USER_MANAGED="USER_MANAGED"),
            TensorIOMode=types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT"))
        self.info = TrtInfo(flavour="tensorrt_rtx", module_name="emulated", version=(1, 7, 1, 116), can_build=False,
                            has_kv_cache_update_layer=True, has_rotary_layer=True, has_attention_layer=True,
                            weakly_typed_allowed=False, has_timing_cache=False, has_runtime_cache=False,
                            has_engine_validity=False, has_aliased_io=True, has_version_compatible=False,
                            has_compute_capability=False)

    def session(self, path: Path) -> ort.InferenceSession:
        if path not in self._sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.log_severity_level = 3  # TensorScatter says it copies the cache (the emulator writes it back in place)
            self._sessions[path] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return self._sessions[path]


# ---------------------------------------------------------------- setup
def install(monkeypatch: Any, free_bytes: int = 8 << 30) -> tuple[Device, EmulatedTensorRT]:
    """Point plugins/cuda_mem.py and the trt backend's TensorRT at the emulator (undone by ``monkeypatch``)."""
    from decodert.plugins import cuda_mem
    from decodert.runtime.backends.trt import backend as trt_backend

    device = Device(free_bytes)
    for name, value in device.api().items():
        monkeypatch.setattr(cuda_mem, name, value)
    trt = EmulatedTensorRT(device)
    from decodert.runtime.backends.trt import seq2seq as trt_seq2seq

    monkeypatch.setattr(trt_backend, "load_trt", lambda *a, **k: (trt.module, trt.info))
    monkeypatch.setattr(trt_seq2seq, "load_trt", lambda *a, **k: (trt.module, trt.info))
    return device, trt


def emulate_engines(folder: Path, max_batch: int | None = None, max_seq: int | None = None,
                    graphs: tuple[str, ...] = ("prefill", "decode", "verify", VISION, AUDIO),
                    scratch: dict[str, int] | None = None) -> None:
    """Write an emulated ``<graph>.engine`` per graph and record them in manifest.engines, with the
    profiles ``decodert build --max-batch/--max-seq`` would give (the vision and audio graphs' too, when there are)."""
    folder = Path(folder)
    m = load_manifest(folder, verify="none")
    batch, seq = max_batch or m.max_batch, max_seq or m.max_seq
    records = {}
    for name in graphs:
        if name not in m.graphs and not (name == VISION and m.vision is not None) \
                and not (name == AUDIO and m.audio is not None):
            continue
        graph = graph_of(m, name)
        shapes = profile_shapes(graph, name, batch, seq, max_tiles(m), max_patches(m), audio_ranges(m))
        profile = {k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in shapes.items()}
        blob = json.dumps({"magic": MAGIC, "graph": str((folder / graph.file).resolve()), "profile": profile,
                           "scratch": (scratch or {}).get(name, 1 << 12)}).encode()
        (folder / f"{name}.engine").write_bytes(blob)
        records[name] = EngineRecord(file=f"{name}.engine", size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                                     tensorrt={"flavour": "tensorrt_rtx", "version": VERSION, "module": "emulated"},
                                     precision=m.dtype, strongly_typed=True, max_batch=batch, max_seq=seq,
                                     profile=profile)
    write_manifest(folder, m.replace(engines=records))


def emulate_seq2seq_engines(folder: Path, max_batch: int | None = None, max_seq: int | None = None,
                            scratch: int = 1 << 12) -> None:
    """An encoder-decoder artifact (seq2seq.json): an emulated encoder.engine and decoder.engine under the profiles
    ``decodert build`` gives them (export/trt_seq2seq.py), recorded in seq2seq.json ``engines``."""
    from decodert.artifact.records import to_json
    from decodert.artifact.seq2seq import graph_record, read_seq2seq, write_engines
    from decodert.export.trt_seq2seq import seq2seq_profile

    folder = Path(folder)
    record = read_seq2seq(folder, verify="none")
    batch = max_batch or int(record["max_batch"])
    seq = max_seq or int(record["spec"]["max_target_positions"]) // 2
    engines = {}
    for name, file in record["graphs"].items():
        shapes = seq2seq_profile(graph_record(folder / file), batch, seq)
        profile = {k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in shapes.items()}
        blob = json.dumps({"magic": MAGIC, "graph": str((folder / file).resolve()), "profile": profile,
                           "scratch": scratch}).encode()
        (folder / f"{name}.engine").write_bytes(blob)
        engines[name] = to_json(EngineRecord(file=f"{name}.engine", size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                                             tensorrt={"flavour": "tensorrt_rtx", "version": VERSION, "module": "emulated"},
                                             precision=str(record["dtype"]), strongly_typed=True, max_batch=batch,
                                             max_seq=seq, profile=profile))
    write_engines(folder, record, engines)
