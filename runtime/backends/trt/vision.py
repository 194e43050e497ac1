"""The vision engine of the trt backend (runtime/backends/trt/backend.py), with an ORT-session-like ``run`` and
``get_outputs`` so runtime/vision/encoder.py calls it as it calls vision.onnx on ONNX Runtime.

    feeds (host) --h2d-->  every input of the vision graph:  pixel_values [n, 3, S, S] (SigLIP towers) or
                           [P, 3*T*p*p] (Qwen towers) with patch_positions [P, 2] and patch_windows [P]
                           (Qwen2.5-VL) | pos_indices / pos_weights [P, 4] (Qwen3-VL)
    outputs      <--d2h--  image_embeds [n, T, hidden] | [P / r^2, hidden]  (and deepstack_embeds [k, P / r^2, hidden])

The engine's profile spans the graph's symbolic dims (images, or patches: export/trt_graphs.py); the output
shapes follow from the inputs' (``output_shapes``). It runs on the backend's stream and scratch memory.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from decodert.artifact.manifest import GraphRecord, TensorInfo
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.runtime.backends.trt.engine import Engine, Staged, bind

HOST_DTYPES: dict[str, Any] = {**NUMPY_DTYPES, "int64": np.int64}


def output_shapes(graph: GraphRecord, feeds: Mapping[str, np.ndarray], merge: int) -> dict[str, tuple[int, ...]]:
    """The outputs' shapes: the symbolic dims the inputs bind (images, patches), and image_tokens = patches / merge^2
    (a Qwen tower's merged patch rows)."""
    dims: dict[str, int] = {}
    for t in graph.inputs:
        dims.update({d: int(n) for d, n in zip(t.shape, feeds[t.name].shape) if isinstance(d, str)})
    if "patches" in dims:
        dims["image_tokens"] = dims["patches"] // (merge * merge)
    return {t.name: tuple(dims[d] if isinstance(d, str) else int(d) for d in t.shape) for t in graph.outputs}


class VisionRunner:
    """vision.engine: each input staged from the feeds, each output copied back, on the backend's stream and scratch."""

    def __init__(self, backend: Any, blob: bytes) -> None:
        self.backend = backend
        self.engine = Engine(backend, "vision", blob)
        self.graph: GraphRecord = backend.manifest.vision.graph
        self.merge = int(backend.manifest.vision.spec.get("scale_factor", 1))
        self.ctx: Any = None
        self._bufs = {t.name: Staged() for t in (*self.graph.inputs, *self.graph.outputs)}

    def get_outputs(self) -> tuple[TensorInfo, ...]:
        """The outputs (each with its ``name``), as an ORT session lists them."""
        return self.graph.outputs

    def run(self, names: list[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        b = self.backend
        if self.ctx is None:
            self.ctx = self.engine.context(b.scratch)
        arrays = {t.name: np.ascontiguousarray(feeds[t.name], HOST_DTYPES[t.dtype]) for t in self.graph.inputs}
        shapes = output_shapes(self.graph, arrays, self.merge)
        dtypes = {t.name: np.dtype(HOST_DTYPES[t.dtype]) for t in self.graph.outputs}
        sizes = {name: int(np.prod(shape)) * dtypes[name].itemsize for name, shape in shapes.items()}
        addresses = {name: self._bufs[name].put(arr, b.stream) for name, arr in arrays.items()}
        addresses.update({name: self._bufs[name].reserve(n) for name, n in sizes.items()})
        bind(self.ctx, addresses, {name: arr.shape for name, arr in arrays.items()})
        b.execute(self.ctx, "vision")
        for name in names:
            self._bufs[name].fetch(sizes[name], b.stream)
        b.stream.sync()
        return [self._host(name)[: sizes[name]].copy().view(dtypes[name]).reshape(shapes[name]) for name in names]

    def _host(self, name: str) -> np.ndarray:
        host = self._bufs[name].host
        assert host is not None
        return host.array

    def free(self) -> None:
        self.ctx = None
        for buf in self._bufs.values():
            buf.free()
