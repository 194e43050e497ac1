"""Images and audio on the trt backend (runtime/backends/trt/backend.py): whether the engines take them, and the
prefill engine's image inputs (an audio clip's rows are placed as image rows: docs/features/audio.md).

    prefill.engine  image_embeds [N, hidden], image_positions [N] (b*S + s of the bound [k, S] block) and,
                    for Gemma 3, image_ahead [N], for Qwen3-VL deepstack_embeds [k, N, hidden]: the store's rows
                    at a call's image ids (``ImageInputs.bind``, the arrays runtime/backends/image_feeds.py makes
                    for ort too), 0 rows for a call without images (the build profile allows 0: export/trt_graphs.py)
    vision.engine   runtime/backends/trt/vision.py;  M-RoPE's rope_offsets: runtime/backends/trt/mrope.py
    audio.engine    runtime/backends/trt/vision.py (the same runner)

Host staging is pinned and device buffers grow to the largest call seen; each call syncs the stream
before its staging is written again, so a buffer is never rewritten while a copy reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.plugins.trt.compat import read_engine
from decodert.runtime.backends.image_feeds import image_arrays
from decodert.runtime.backends.trt.engine import Staged
from decodert.artifact.trt_engines import AUDIO, VISION
from decodert.runtime.backends.trt.vision import EncoderRunner, audio_runner, vision_runner
from decodert.runtime.vision.tokens import is_image


def open_images(backend: Any) -> tuple["ImageInputs | None", "EncoderRunner | None"]:
    """The prefill engine's image inputs (None: it takes none) and the vision engine. Images run when the artifact
    has a vision graph and engine and the text engines take what its model needs (Qwen-VL: rope_offsets, and
    Qwen3-VL's deepstack rows); else the vision runner is None and images are refused (engines built before those
    inputs were kept), while text prompts bind 0 image rows."""
    m = backend.manifest
    recs = m.engines or {}
    inputs = [t.name for t in m.graphs["prefill"].inputs if t.name in (recs["prefill"].profile or {})]
    if "image_embeds" not in inputs:
        return None, None
    images = ImageInputs(backend, inputs)
    complete = ("vision" in recs and m.vision is not None
                and (backend.mrope is not None or m.model.mrope is None)
                and ("deepstack_embeds" in inputs or not (m.model.images and m.model.images.deepstack_layers)))
    if not complete:
        return images, None
    return images, vision_runner(backend, read_engine(backend.dir, m, VISION, backend.info))


def open_audio(backend: Any, images: "ImageInputs | None") -> "EncoderRunner | None":
    """The audio engine, when the artifact has audio.onnx and audio.engine and the prefill engine takes embedding
    rows (``images``); else None, and audio is refused (engines built before audio.engine was)."""
    m = backend.manifest
    if images is None or m.audio is None or AUDIO not in (m.engines or {}):
        return None
    return audio_runner(backend, read_engine(backend.dir, m, AUDIO, backend.info))


class ImageInputs:
    """The prefill engine's image inputs, bound per call from the backend's image store (``backend.images``)."""

    def __init__(self, backend: Any, names: list[str]) -> None:
        self.backend = backend
        self.ahead = "image_ahead" in names
        images = backend.manifest.model.images
        self.deepstack = images.deepstack_layers if "deepstack_embeds" in names and images is not None else 0
        self.dtype = NUMPY_DTYPES[backend.manifest.dtype]
        self.hidden = int(backend.manifest.model.hidden_size)
        self._bufs = {n: Staged() for n in ("image_embeds", "image_positions", "image_ahead", "deepstack_embeds")}

    def bind(self, ids: np.ndarray) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
        """For the [k, S] ids block of a call (image ids mapped back to ``<image>`` in place): the image inputs'
        addresses and shapes."""
        arrays = image_arrays(ids, self.backend.images, self.hidden, self.dtype, self.deepstack, self.ahead)
        stream = self.backend.stream
        addresses = {name: self._bufs[name].put(arr, stream) for name, arr in arrays.items()}
        return addresses, {name: arr.shape for name, arr in arrays.items()}

    def check_chunks(self, rows: list[np.ndarray], chunk: int) -> None:
        """Gemma 3: an image's tokens see each other, so a prefill chunk must not cut one (one-line error).
        Elsewhere a chunk may cut an image (causal image tokens; M-RoPE offsets follow from the ids held)."""
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
