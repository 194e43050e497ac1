"""Images on the trt backend (runtime/backends/trt_backend.py): the vision engine, and the prefill engine's
image inputs.

    vision.engine   pixel_values [n, 3, S, S] fp32 --h2d--> run --d2h--> image_embeds [n, T, hidden]
                    (``VisionRunner.run``: what runtime/vision/encoder.py calls, as it calls an ORT session)
    prefill.engine  image_embeds [N, hidden], image_positions [N] (b*S + s of the bound [k, S] block) and,
                    for Gemma 3, image_ahead [N]: the store's rows at a call's image ids (``ImageInputs.bind``),
                    0 rows for a call without images (the build profile allows 0: export/trt_build.py)

Host staging is pinned and device buffers grow to the largest call seen; each call syncs the stream
before its staging is written again, so a buffer is never rewritten while a copy reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.export.artifact.weights import NUMPY_DTYPES
from decodert.plugins import cuda_mem as cm
from decodert.plugins.trt.compat import read_engine
from decodert.runtime.backends.trt_engine import Engine, bind
from decodert.runtime.vision.tokens import image_ahead, is_image, text_ids


def open_images(backend: Any) -> tuple["ImageInputs | None", "VisionRunner | None"]:
    """The backend's image path when the artifact has a vision graph, its vision engine and a prefill
    engine built with the image inputs (an engine built before they were kept takes none: (None, None))."""
    m = backend.manifest
    recs = m.engines or {}
    inputs = [t.name for t in m.graphs["prefill"].inputs if t.name in (recs["prefill"].profile or {})]
    if m.vision is None or "image_embeds" not in inputs or "vision" not in recs:
        return None, None
    if m.model.extra.get("mrope_section") or m.model.extra.get("deepstack_layers"):
        return None, None  # Qwen-VL: rope_offsets / deepstack rows are folded in the trt engines; images run on ort
    return ImageInputs(backend, inputs), VisionRunner(backend, read_engine(backend.dir, m, "vision", backend.info))


class _Staged:
    """A pinned host buffer and a device buffer of the same size, grown on demand."""

    def __init__(self) -> None:
        self.host: cm.PinnedArray | None = None
        self.dev: cm.DeviceBuffer | None = None

    def put(self, arr: np.ndarray, stream: cm.Stream) -> int:
        """Copy ``arr`` to the device (enqueued on ``stream``); returns the device address."""
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        if self.host is None or self.host.nbytes < raw.size:
            self.free()
            self.host, self.dev = cm.PinnedArray((max(raw.size, 1),), np.uint8), cm.DeviceBuffer(max(raw.size, 1))
        assert self.dev is not None
        self.host.array[: raw.size] = raw
        cm.copy_async(self.dev.ptr, self.host.ptr, raw.size, stream, "h2d")
        return self.dev.ptr

    def free(self) -> None:
        for buf in (self.host, self.dev):
            if buf is not None:
                buf.free()
        self.host = self.dev = None


class ImageInputs:
    """The prefill engine's image inputs, bound per call from the backend's image store (``backend.images``)."""

    def __init__(self, backend: Any, names: list[str]) -> None:
        self.backend = backend
        self.ahead = "image_ahead" in names
        self.dtype = NUMPY_DTYPES[backend.manifest.dtype]
        self.hidden = int(backend.manifest.model.hidden_size)
        self._bufs = {n: _Staged() for n in ("image_embeds", "image_positions", "image_ahead")}

    def bind(self, ids: np.ndarray) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
        """For the [k, S] ids block of a call (image ids mapped back to ``<image>`` in place): the image inputs'
        addresses and shapes."""
        store = self.backend.images
        found = store.rows(ids) if store is not None else None
        if found is None:
            found = (np.zeros(0, np.int64), np.zeros((0, self.hidden), self.dtype))
        else:
            ids[:] = text_ids(ids)
        arrays = {"image_positions": found[0].astype(np.int64), "image_embeds": np.asarray(found[1], self.dtype)}
        if self.ahead:
            arrays["image_ahead"] = image_ahead(found[0], ids.shape[1])
        stream = self.backend.stream
        addresses = {name: self._bufs[name].put(arr, stream) for name, arr in arrays.items()}
        return addresses, {name: arr.shape for name, arr in arrays.items()}

    def check_chunks(self, rows: list[np.ndarray], chunk: int) -> None:
        """Gemma 3: an image's tokens see each other, so a prefill chunk must not cut one (one-line error)."""
        if not self.ahead:
            return
        for row in rows:
            image = is_image(row)
            cuts = np.arange(chunk, len(row), chunk)
            if cuts.size and (image[cuts - 1] & image[cuts]).any():
                raise DecodertError(f"an image in this {len(row)}-token prompt spans the prefill engine's {chunk}-token "
                                    "chunk; rebuild the engines with a larger --max-seq")

    def free(self) -> None:
        for buf in self._bufs.values():
            buf.free()


class VisionRunner:
    """vision.engine with an ORT-session-like ``run`` (runtime/vision/encoder.py), on the backend's stream and scratch."""

    def __init__(self, backend: Any, blob: bytes) -> None:
        self.backend = backend
        self.engine = Engine(backend, "vision", blob)
        self.out_dtype = NUMPY_DTYPES[backend.manifest.dtype]
        self.ctx: Any = None
        self._pixels, self._out = _Staged(), cm.DeviceBuffer(1)
        self._host: cm.PinnedArray | None = None

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        b = self.backend
        pixels = np.ascontiguousarray(feeds["pixel_values"], np.float32)
        n = pixels.shape[0]
        spec = b.manifest.vision.spec
        side = int(spec["image_size"]) // int(spec["patch_size"]) // int(spec["scale_factor"])
        shape = (n, side * side, int(spec["out_hidden"]))
        nbytes = int(np.prod(shape)) * np.dtype(self.out_dtype).itemsize
        if self._host is None or self._host.nbytes < nbytes:
            for buf in (self._host, self._out):
                if buf is not None:
                    buf.free()
            self._host, self._out = cm.PinnedArray((nbytes,), np.uint8), cm.DeviceBuffer(nbytes)
        if self.ctx is None:
            self.ctx = self.engine.context(b.scratch)
        addresses = {"pixel_values": self._pixels.put(pixels, b.stream), "image_embeds": self._out.ptr}
        bind(self.ctx, addresses, {"pixel_values": pixels.shape})
        b.execute(self.ctx, "vision")
        cm.copy_async(self._host.ptr, self._out.ptr, nbytes, b.stream, "d2h")
        b.stream.sync()
        return [self._host.array[:nbytes].copy().view(self.out_dtype).reshape(shape)]

    def free(self) -> None:
        self.ctx = None
        self._pixels.free()
        for buf in (self._host, self._out):
            if buf is not None:
                buf.free()
