"""vision.onnx on ONNX Runtime, and the store of image embeddings the prefill reads by image id.

    vision = Vision.open(folder, manifest, threads)       # None for a text-only artifact
    ids = vision.prompt_ids(text, images, encode)          # <image> placeholders expanded, image ids placed
    positions, rows = vision.store.rows(ids_block)         # what a prefill call binds (runtime/backends)

An image is preprocessed and encoded once: the store keeps its embeddings (and its tile grid, which
the prompt text needs) under its pixel digest, the last ``capacity`` images, so asking about the same
image again costs neither (runtime/vision/tokens.py: its tokens are the same image ids). A request in
flight holds its images' entries (``pin``, kept on its Sequence), so a busy server evicting older
images from the store never takes the rows of a prompt that has not been prefilled yet.
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.models.vision import VisionSpec
from decodert.runtime.vision import gemma3
from decodert.runtime.vision import preprocess as pre
from decodert.runtime.vision.tokens import IMAGE_FLAG, image_ids, pixel_digest


# image processors by the ``kind`` their export settings name (Idefics3's have none): each module gives
# placeholder(settings), image_token(settings), preprocess(rgb, settings) -> Tiles and prompt(tiles, settings)
PROCESSORS: dict[str, Any] = {"idefics3": pre, "gemma3": gemma3}


@dataclass(eq=False)
class _Entry:
    ids: np.ndarray  # [n] image ids
    embeds: np.ndarray  # [n, hidden] graph dtype
    rows: int
    cols: int

    def __post_init__(self) -> None:
        self.index = {int(v): k for k, v in enumerate(self.ids)}  # image id -> row


class ImageStore:
    """Image embeddings by pixel digest, the last ``capacity`` images; image id -> its row."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # the last `capacity`
        self._where: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()  # image id -> entry,
        self._lock = threading.Lock()  # while the LRU or a pinning request holds it

    def get(self, digest: bytes) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
            return entry

    def put(self, digest: bytes, entry: _Entry) -> None:
        with self._lock:
            self._entries[digest] = entry
            self._where.update(dict.fromkeys(entry.index, entry))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def pin(self, ids: np.ndarray) -> list[_Entry]:
        """The entries of the images ``ids`` refers to: whoever keeps the list keeps their rows readable."""
        with self._lock:
            found = {id(e): e for e in (self._where.get(int(v)) for v in ids[ids >= IMAGE_FLAG]) if e is not None}
        return list(found.values())

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """For a block of ids (any shape): (flat positions [N] of its image ids, their embeddings [N, hidden]),
        or None when it holds none. The ids are not changed."""
        flat = ids.reshape(-1)
        positions = np.flatnonzero(flat >= IMAGE_FLAG)
        if positions.size == 0:
            return None
        with self._lock:
            try:
                rows = np.stack([(e := self._where[v]).embeds[e.index[v]] for v in map(int, flat[positions])])
            except KeyError:
                raise DecodertError("an image of this prompt is no longer in the image store; send it again") from None
        return positions.astype(np.int64), rows


class Vision:
    """An artifact's vision graph, its image processor settings and its embedding store."""

    def __init__(self, session: Any, spec: VisionSpec, settings: dict, image_token_id: int, np_dtype: type) -> None:
        self.session, self.spec, self.settings = session, spec, settings
        self.image_token_id, self.np_dtype = image_token_id, np_dtype
        self.seq_len = int(settings["image_seq_len"])
        self.processor = PROCESSORS[settings.get("kind", "idefics3")]
        self.store = ImageStore()
        self.encode_seconds = 0.0  # the last image encoded (bench/vision.py)

    @classmethod
    def attach(cls, backend: Any, manifest: Any) -> "Vision | None":
        """The artifact's vision path over ``backend`` (its prefill then reads this store), or None for a
        text-only artifact or a backend whose prefill takes no images. The graph runs on the backend's own
        runner when it has one (trt: vision.engine), else on ONNX Runtime."""
        if manifest is None or manifest.vision is None or not getattr(backend, "_takes_images", False):
            return None
        from decodert.export.artifact.weights import NUMPY_DTYPES

        v = manifest.vision
        session = getattr(backend, "vision", None)
        if session is None:
            from decodert.runtime.backends.ort_backend import open_session

            session = open_session(Path(backend.dir) / v.graph.file, backend._options, backend._providers)
        token = manifest.model.extra.get("image_token_id")
        vision = cls(session, VisionSpec.from_dict(dict(v.spec)), dict(v.processor), int(token),
                     NUMPY_DTYPES[manifest.dtype])
        backend.images = vision.store
        return vision

    def entry(self, rgb: np.ndarray) -> _Entry:
        """The image's embeddings and tile grid: from the store, else preprocessed and encoded now."""
        import time

        digest = pixel_digest(rgb)
        entry = self.store.get(digest)
        if entry is None:
            t0 = time.perf_counter()
            tiles = self.processor.preprocess(rgb, self.settings)
            embeds = self.session.run(["image_embeds"], {"pixel_values": tiles.pixels})[0]  # [n_tiles, T, hidden]
            embeds = embeds.reshape(-1, embeds.shape[-1])
            entry = _Entry(image_ids(digest, self.image_token_id, len(embeds)), embeds, tiles.rows, tiles.cols)
            self.store.put(digest, entry)
            self.encode_seconds = time.perf_counter() - t0
        return entry

    def prompt_ids(self, text: str, images: Sequence[np.ndarray], encode: Callable[[str], np.ndarray]) -> np.ndarray:
        """The rendered prompt with one ``<image>`` per image -> ids, each image's tokens its image ids."""
        proc, mark = self.processor, self.processor.placeholder(self.settings)
        parts = text.split(mark)
        if len(parts) - 1 != len(images):
            raise DecodertError(f"the prompt has {len(parts) - 1} {mark} placeholders for {len(images)} images "
                                "(the chat template places one per image part)")
        entries = [self.entry(rgb) for rgb in images]
        grids = [pre.Tiles(np.empty(0), e.rows, e.cols) for e in entries]
        expanded = parts[0] + "".join(proc.prompt(t, self.settings) + p for t, p in zip(grids, parts[1:]))
        ids = encode(expanded).copy()
        at = np.flatnonzero(ids == self.image_token_id)
        want = sum(len(e.ids) for e in entries)
        if len(at) != want:
            raise DecodertError(f"the prompt has {len(at)} image tokens where its images need {want}; "
                                f"does the text itself contain {proc.image_token(self.settings)}?")
        ids[at] = np.concatenate([e.ids for e in entries])
        return ids
