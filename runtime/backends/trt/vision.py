"""The encoder engines of the trt backend (runtime/backends/trt/backend.py): vision.engine and audio.engine, each
with an ORT-session-like ``run`` and ``get_outputs``, so runtime/vision/encoder.py and runtime/audio/encoder.py call
them as they call vision.onnx / audio.onnx on ONNX Runtime.

    feeds (host) --h2d-->  every input of the vision graph:  pixel_values [n, 3, S, S] (SigLIP towers) or
                           [P, 3*T*p*p] (Qwen towers) with patch_positions [P, 2] and patch_windows [P]
                           (Qwen2.5-VL) | pos_indices / pos_weights [P, 4] (Qwen3-VL)
    outputs      <--d2h--  image_embeds [n, T, hidden] | [P / r^2, hidden]  (and deepstack_embeds [k, P / r^2, hidden])

    feeds (host) --h2d-->  every input of the audio graph: input_features [chunks, M, 2 n_window] fp32,
                           key_valid [windows, window_slots] bool, token_slots [audio_tokens] int64
    outputs      <--d2h--  audio_embeds [audio_tokens, hidden]

An engine's profile spans the graph's symbolic dims (images, patches, or chunks / windows / audio_tokens:
export/trt_graphs.py); the output shapes follow from the inputs' (``output_shapes``). It runs on the backend's
stream and scratch memory.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from decodert.artifact.manifest import GraphRecord, TensorInfo
from decodert.artifact.trt_engines import AUDIO, VISION, graph_of
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.runtime.backends.trt.engine import Engine, Staged, bind

HOST_DTYPES: dict[str, Any] = {**NUMPY_DTYPES, "int64": np.int64, "bool": np.bool_}


def output_shapes(graph: GraphRecord, feeds: Mapping[str, np.ndarray], merge: int) -> dict[str, tuple[int, ...]]:
    """The outputs' shapes: the symbolic dims the inputs bind (images, patches), and image_tokens = patches / merge^2
    (a Qwen tower's merged patch rows)."""
    dims: dict[str, int] = {}
    for t in graph.inputs:
        dims.update({d: int(n) for d, n in zip(t.shape, feeds[t.name].shape) if isinstance(d, str)})
    if "patches" in dims:
        dims["image_tokens"] = dims["patches"] // (merge * merge)
    return {t.name: tuple(dims[d] if isinstance(d, str) else int(d) for d in t.shape) for t in graph.outputs}


class EncoderRunner:
    """An encoder engine (``name``: "vision" or "audio", artifact/trt_engines.py graph_of): each input staged from
    the feeds, each output copied back, on the backend's stream and scratch. ``merge``: a Qwen tower's merge size."""

    def __init__(self, backend: Any, name: str, blob: bytes, merge: int = 1) -> None:
        self.backend, self.name, self.merge = backend, name, merge
        self.engine = Engine(backend, name, blob)
        self.graph: GraphRecord = graph_of(backend.manifest, name)
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
        b.execute(self.ctx, self.name)
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


def vision_runner(backend: Any, blob: bytes) -> EncoderRunner:
    """vision.engine (runtime/backends/trt/images.py opens it)."""
    return EncoderRunner(backend, VISION, blob, int(backend.manifest.vision.spec.get("scale_factor", 1)))


def audio_runner(backend: Any, blob: bytes) -> EncoderRunner:
    """audio.engine (runtime/backends/trt/images.py opens it)."""
    return EncoderRunner(backend, AUDIO, blob)
