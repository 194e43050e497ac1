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
import hashlib
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.models.vision import VisionSpec
from decodert.runtime.vision import gemma3
from decodert.runtime.vision import preprocess as pre
from decodert.runtime.vision import qwen_preprocess as qp
from decodert.runtime.vision import qwen_video as qv
from decodert.runtime.vision.tokens import IMAGE_FLAG, image_ids, pixel_digest
from decodert.runtime.vision.video import Video


# image processors by the ``kind`` their export settings name (Idefics3's have none): each module gives
# placeholder(settings), image_token(settings), preprocess(rgb, settings) -> Tiles and prompt(tiles, settings)
PROCESSORS: dict[str, Any] = {"idefics3": pre, "gemma3": gemma3}


@dataclass(eq=False)
class _Entry:
    ids: np.ndarray  # [n] image ids
    embeds: np.ndarray  # [n, hidden] graph dtype
    rows: int
    cols: int
    extra: dict[str, np.ndarray] | None = None  # per-token features beside embeds, [k, n, hidden] (Qwen3-VL deepstack)
    frames: int = 1  # grid slices (a video: t > 1), each rows x cols tokens
    interval: float = 0.0  # M-RoPE temporal step between slices (runtime/vision/mrope.py)
    split: bool = False  # each slice a grid of its own (Qwen3-VL: timestamp text between slices)

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

    def locate(self, image_id: int) -> tuple[int, int, int, int, float] | None:
        """(index in its image or video, rows, cols, slices, temporal step of its grid) of an image id, or None
        (runtime/vision/mrope.py)."""
        with self._lock:
            e = self._where.get(image_id)
            if e is None:
                return None
            k = e.index[image_id]
            return (k % (e.rows * e.cols), e.rows, e.cols, 1, 0.0) if e.split else (k, e.rows, e.cols, e.frames, e.interval)

    def extra_rows(self, ids: np.ndarray, name: str) -> np.ndarray:
        """The ``name`` features [k, N, hidden] of the image ids in ``ids`` (flat order, as ``rows``)."""
        flat = ids.reshape(-1)
        with self._lock:
            return np.stack([(e := self._where[v]).extra[name][:, e.index[v]]  # type: ignore[index]
                             for v in map(int, flat[flat >= IMAGE_FLAG])], axis=1)

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
        self.seq_len = int(settings.get("image_seq_len", 0))
        self.processor = PROCESSORS[settings.get("kind", "idefics3")]
        self.qwen = spec.tower in ("qwen_vit", "qwen3_vit")  # patch rows + <|image_pad|> (runtime/vision/qwen_preprocess.py)
        self.video: dict | None = settings.get("video")  # the video processor's settings (runtime/vision/qwen_video.py)
        self.store = ImageStore()
        self.encode_seconds = 0.0  # the last image encoded (bench/vision.py)

    @classmethod
    def attach(cls, backend: Any, manifest: Any) -> "Vision | None":
        """The artifact's vision path over ``backend`` (its prefill then reads this store), or None for a
        text-only artifact or a backend whose prefill takes no images. The graph runs on the backend's own
        runner when it has one (trt: vision.engine), else on ONNX Runtime."""
        if manifest is None or manifest.vision is None or not getattr(backend, "takes_images", False):
            return None
        from decodert.artifact.weights import NUMPY_DTYPES

        v = manifest.vision
        session = getattr(backend, "vision", None)
        if session is None:
            session = backend.open_graph(v.graph.file)
        token = manifest.model.images.token_id if manifest.model.images is not None else None
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
            embeds, rows, cols, extra = self._encode(rgb)
            entry = _Entry(image_ids(digest, self.image_token_id, len(embeds)), embeds, rows, cols, extra)
            self.store.put(digest, entry)
            self.encode_seconds = time.perf_counter() - t0
        return entry

    def _encode(self, rgb: np.ndarray) -> tuple[np.ndarray, int, int, dict[str, np.ndarray] | None]:
        """-> (embeddings [n, hidden], rows, cols, extra features): the tile grid (Idefics3) or the merged token
        grid (Qwen); Qwen3-VL's deepstack features [k, n, hidden] as extra["deepstack_embeds"]."""
        if self.qwen:
            p = qp.preprocess(rgb, self.settings, self.spec)
            embeds, extra = self._run_qwen(p)
            return embeds, p.rows, p.cols, extra
        tiles = self.processor.preprocess(rgb, self.settings)
        embeds = self.session.run(["image_embeds"], {"pixel_values": tiles.pixels})[0]  # [n_tiles, T, hidden]
        return embeds.reshape(-1, embeds.shape[-1]), tiles.rows, tiles.cols, None

    def _run_qwen(self, p: qp.Patches) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """One grid slice (an image, or two frames of a video) through vision.onnx -> its rows in image order."""
        feed = {"pixel_values": p.pixels, "patch_positions": p.positions}
        if p.taps is not None:
            feed.update(pos_indices=p.taps[0], pos_weights=p.taps[1])
        else:
            feed["patch_windows"] = p.windows
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(names, feed)))
        extra = {"deepstack_embeds": out["deepstack_embeds"][:, p.restore]} if "deepstack_embeds" in out else None
        return out["image_embeds"][p.restore], extra

    def video_entry(self, video: Video) -> tuple[_Entry, str]:
        """A video's entry (its t slices of rows x cols tokens) and the text its placeholder becomes; from the
        store, else preprocessed and encoded now (slice by slice)."""
        s = self.video
        if s is None:
            raise DecodertError("this model takes no video (its processor has none); send the frames as images")
        t = qv.timing(len(video.frames), video.fps, s)
        digest = hashlib.blake2b(pixel_digest(video.frames) + repr(video.fps).encode(), digest_size=16).digest()
        entry = self.store.get(digest)
        if entry is None:
            slices = qv.preprocess(video.frames, t.keep, s, self.spec)
            runs = [self._run_qwen(p) for p in slices]
            embeds = np.concatenate([e for e, _ in runs])
            extra = None if runs[0][1] is None else {n: np.concatenate([x[n] for _, x in runs], axis=1)  # type: ignore[index]
                                                     for n in runs[0][1]}
            entry = _Entry(image_ids(digest, int(s["video_token_id"]), len(embeds)), embeds, slices[0].rows,
                           slices[0].cols, extra, len(slices), t.interval, split=bool(s.get("timestamps")))
            self.store.put(digest, entry)
        return entry, qv.prompt(entry.rows, entry.cols, t.times, s)

    def _expand(self, entry: _Entry) -> str:
        """The text one image placeholder of the template becomes."""
        if self.qwen:
            return qp.image_prompt(entry.rows, entry.cols)
        return self.processor.prompt(pre.Tiles(np.empty(0), entry.rows, entry.cols), self.settings)

    def prompt_ids(self, text: str, media: Sequence[np.ndarray | Video], encode: Callable[[str], np.ndarray]) -> np.ndarray:
        """The rendered prompt with one placeholder per image and per video -> ids, each image's and video's
        tokens its image ids. Images fill the image placeholders in order, videos the video ones."""
        if self.qwen:
            mark = token = qp.IMAGE_PAD
        else:
            mark, token = self.processor.placeholder(self.settings), self.processor.image_token(self.settings)
        images = [m for m in media if not isinstance(m, Video)]
        videos = [m for m in media if isinstance(m, Video)]
        if videos and self.video is None:
            raise DecodertError("this model takes no video (its processor has none); send the frames as images")
        video_marks = [] if self.video is None else sorted({qv.placeholder(self.video), qv.VIDEO_PAD}, key=len, reverse=True)
        pieces = re.split("(" + "|".join(map(re.escape, [*video_marks, mark])) + ")", text)
        marks = pieces[1::2]
        n_images = sum(m == mark for m in marks)
        if n_images != len(images) or len(marks) - n_images != len(videos):
            raise DecodertError(f"the prompt has {n_images} {mark} placeholders for {len(images)} images and "
                                f"{len(marks) - n_images} video placeholders for {len(videos)} videos (the chat "
                                "template places one per image or video part)" if videos or self.video is not None
                                else f"the prompt has {n_images} {mark} placeholders for {len(images)} images "
                                     "(the chat template places one per image part)")
        image_it, video_it = iter(images), iter(videos)
        entries: list[_Entry] = []
        out = [pieces[0]]
        for m, after in zip(marks, pieces[2::2]):
            if m == mark:
                entries.append(self.entry(next(image_it)))
                out.append(self._expand(entries[-1]))
            else:
                entry, expanded = self.video_entry(next(video_it))
                entries.append(entry)
                out.append(expanded)
            out.append(after)
        ids = encode("".join(out)).copy()
        tokens = [self.image_token_id] + ([int(self.video["video_token_id"])] if self.video is not None else [])
        at = np.flatnonzero(np.isin(ids, tokens))
        want = sum(len(e.ids) for e in entries)
        if len(at) != want:
            raise DecodertError(f"the prompt has {len(at)} image tokens where its images need {want}; "
                                f"does the text itself contain {token}?")
        if want:
            ids[at] = np.concatenate([e.ids for e in entries])
        return ids
