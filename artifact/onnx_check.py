"""Checks on an artifact's ONNX graphs before a runtime loads them (they may come from anywhere).

- ``check_external_data(path)``: every tensor stored outside the .onnx file (initializers, sparse
  initializers, constant attributes, subgraphs) must name a plain file in the graph's own folder
  and lie inside it. A graph pointing at ``../secret`` or ``/etc/passwd`` is refused before any
  runtime opens that file.
- ``check_session_io(session, graph, path)``: a loaded session has the inputs and outputs, with
  the element types, that the manifest's graph contract lists (so binding them cannot fail later).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

import onnx

from decodert.errors import DecodertError
from decodert.artifact.manifest import GraphRecord

# manifest dtype -> onnxruntime type string
ORT_TYPES = {"int64": "tensor(int64)", "int32": "tensor(int32)", "fp32": "tensor(float)", "fp16": "tensor(float16)",
             "bf16": "tensor(bfloat16)", "bool": "tensor(bool)", "int8": "tensor(int8)", "uint8": "tensor(uint8)"}


def _attr_tensors(attr: onnx.AttributeProto) -> Iterator[onnx.TensorProto]:
    yield from ([attr.t] if attr.HasField("t") else [])
    yield from attr.tensors
    for sparse in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors):
        yield from (sparse.values, sparse.indices)
    for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
        yield from graph_tensors(sub)


def graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto a graph holds, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            yield from _attr_tensors(attr)


def load_graph(path: Path) -> onnx.ModelProto:
    """The graph without its external data; DecodertError for a damaged file."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError, RecursionError, ...: a damaged file
        raise DecodertError(f"{path}: not a readable ONNX file ({type(e).__name__})") from None


def _extent(info: Mapping[str, str], key: str) -> int:
    text = info.get(key, "0")
    if not text.isdigit() or len(text) > 20:
        raise ValueError(key)
    return int(text)


def _check_one(t: onnx.TensorProto, folder: Path, path: Path) -> None:
    info = {e.key: e.value for e in t.external_data}
    if not all(isinstance(v, str) for kv in info.items() for v in kv):  # protobuf gives bytes for bad UTF-8
        raise DecodertError(f"{path}: tensor {t.name!r} has external-data entries that are not text (damaged file)")
    location = info.get("location", "")
    target = folder / location
    inside = location and Path(location).name == location and "\0" not in location
    if not inside or target.resolve().parent != folder or not target.is_file():
        raise DecodertError(f"{path}: tensor {t.name!r} points outside the artifact folder ({location!r})")
    try:
        end = _extent(info, "offset") + _extent(info, "length")
    except ValueError as e:
        raise DecodertError(f"{path}: tensor {t.name!r} has a malformed external-data {e}") from None
    if end > target.stat().st_size:
        raise DecodertError(f"{target}: too short for tensor {t.name!r} (file damaged or truncated)")


def check_external_data(path: Path) -> onnx.ModelProto:
    """Refuse graphs whose external data points outside their folder or past the file's end."""
    model = load_graph(path)
    folder = path.parent.resolve()
    for t in graph_tensors(model.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            _check_one(t, folder, path)
    return model


def check_session_io(session: Any, graph: GraphRecord, path: Path) -> None:
    """The session has the manifest graph's inputs/outputs, with the same element types and static dims."""
    listed = {t.name for t in graph.inputs}
    unlisted = [a.name for a in session.get_inputs() if a.name not in listed]
    if unlisted:  # the runtime binds the listed inputs only
        raise DecodertError(f"{path}: graph input {unlisted[0]!r} is not in manifest.json; the file is damaged "
                            "or does not belong to this manifest")
    defaults = session.get_overridable_initializers()  # inputs with a default (an initializer of that name)
    have = {a.name: a for a in [*session.get_inputs(), *defaults, *session.get_outputs()]}
    for t in [*graph.inputs, *graph.outputs]:
        arg = have.get(t.name)
        want = ORT_TYPES.get(t.dtype)
        ok = arg is not None and (want is None or arg.type == want) and len(arg.shape) == len(t.shape)
        ok = ok and all(not (isinstance(a, int) and isinstance(b, int)) or a == b for a, b in zip(arg.shape, t.shape))
        if not ok:
            found = None if arg is None else f"{arg.type}{list(arg.shape)}"
            raise DecodertError(f"{path}: graph {t.name!r} is {found}, manifest.json says {t.dtype}{list(t.shape)}; "
                                "the file is damaged or does not belong to this manifest")
