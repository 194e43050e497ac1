"""An artifact's TensorRT engines as both sides see them: ``decodert build`` (export/trt_build.py) writes them, the trt
backend (runtime/backends/trt/) reads them back, and both check an engine's I/O against the manifest's graph contract.

    graph_of(manifest, name)          the graph record an engine is built from ("prefill", "decode", "verify", "vision")
    engine_io(trt, engine, graph)     a deserialized engine's I/O in manifest form (dynamic dims by their symbolic names)
    check_io(io, graph, where)        DecodertError where that I/O disagrees with the graph contract
    make_logger(trt)                  the TensorRT logger both use (DECODERT_TRT_VERBOSE=1: everything)
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Mapping

from decodert.artifact.graph_contract import DEFAULTED_INPUTS
from decodert.artifact.manifest import GraphRecord, Manifest
from decodert.errors import DecodertError

VISION = "vision"  # vision-language artifacts: vision.onnx (manifest.vision.graph)
AUDIO = "audio"  # audio-language artifacts: audio.onnx (manifest.audio.graph)
_DTYPE_NAMES = {"HALF": "fp16", "BF16": "bf16", "FLOAT": "fp32", "INT64": "int64", "INT32": "int32",
                "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}


def graph_of(manifest: Manifest, name: str) -> GraphRecord:
    """The record of graph ``name``: one of manifest.graphs, or "vision" (manifest.vision.graph)."""
    if name == VISION and manifest.vision is not None:
        return manifest.vision.graph
    if name == AUDIO and manifest.audio is not None:
        return manifest.audio.graph
    return manifest.graphs[name]


def make_logger(trt: ModuleType) -> Any:
    """A TensorRT logger: errors only, everything with DECODERT_TRT_VERBOSE=1."""
    level = trt.Logger.INFO if os.environ.get("DECODERT_TRT_VERBOSE") else trt.Logger.ERROR
    return trt.Logger(level)


def trt_dtype_name(dtype: Any) -> str:
    """tensorrt DataType -> manifest dtype string ("fp16", "bf16", "fp32", "int64", ...)."""
    name = getattr(dtype, "name", str(dtype).split(".")[-1])
    return _DTYPE_NAMES.get(name, name.lower())


def engine_io(trt: ModuleType, engine: Any, graph: GraphRecord) -> dict[str, list[dict[str, Any]]]:
    """The deserialized engine's I/O in manifest form, with the input each output aliases."""
    symbolic = {name: t.shape for name, t in graph.io().items()}
    io: dict[str, list[dict[str, Any]]] = {"inputs": [], "outputs": []}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        names: tuple[int | str, ...] = symbolic.get(name, ())
        shape = [names[k] if d < 0 and k < len(names) else int(d) for k, d in enumerate(engine.get_tensor_shape(name))]
        rec: dict[str, Any] = {"name": name, "dtype": trt_dtype_name(engine.get_tensor_dtype(name)), "shape": shape}
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            io["inputs"].append(rec)
        else:
            if hasattr(engine, "get_aliased_input_tensor"):
                rec["aliases"] = engine.get_aliased_input_tensor(name)
            io["outputs"].append(rec)
    return io


def check_io(io: Mapping[str, Any], graph: GraphRecord, where: str) -> None:
    """DecodertError when the network/engine I/O (``network_io`` form) disagrees with the manifest's graph contract."""
    problems = []
    for kind, tensors in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        got = {t["name"]: (t["dtype"], list(t["shape"])) for t in io[kind]}
        want = {t.name: (t.dtype, list(t.shape)) for t in tensors}
        for name in sorted(set(got) | set(want)):
            if kind == "inputs" and name in DEFAULTED_INPUTS and name not in got:
                continue  # an input with a default initializer: TensorRT's parser folds it into a constant
            if got.get(name) != want.get(name):
                problems.append(f"{name}: manifest {want.get(name)} vs engine {got.get(name)}")
    if problems:
        raise DecodertError(f"{where}: I/O does not match manifest.json: {'; '.join(problems)}")
