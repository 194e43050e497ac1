"""audio.onnx on the backend's graph runner, and the placement of a clip's embeddings at its audio tokens.

    audio = Audio.attach(backend, manifest)                  # None for an artifact without audio.onnx
    ids = audio.prompt_ids(text, clips, encode)             # each <|audio_pad|> expanded, audio ids placed

A clip's embeddings live in the backend's embedding store (runtime/vision/encoder.py ImageStore, shared with
images) under a digest of its samples, and its tokens are held as image ids of the audio token
(runtime/vision/tokens.py): the prefill binds them at those positions exactly as image rows, the KV cache, the
prefix cache and a session compare clips by their samples, and a repeated clip is neither featurised nor
encoded again.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.models.audio import AudioSpec, audio_spec, post_conv
from decodert.runtime.audio import features, features_gemma4
from decodert.runtime.audio.conformer import conformer_feeds
from decodert.runtime.audio.features import MelSettings
from decodert.runtime.vision.encoder import ImageStore, _Entry
from decodert.runtime.vision.tokens import image_ids

AUDIO_PAD = "<|audio_pad|>"  # the placeholder a Qwen3-ASR chat template writes per audio part


def clip_digest(samples: np.ndarray, rate: int) -> bytes:
    """16 bytes naming a clip by its rate and float32 samples."""
    h = hashlib.blake2b(digest_size=16, person=b"decodert-audio")
    h.update(np.asarray([rate, samples.size], np.int64).tobytes())
    h.update(np.ascontiguousarray(samples, np.float32).data)
    return h.digest()


def encoder_feeds(mel: np.ndarray, valid: int, a: AudioSpec) -> dict[str, np.ndarray]:
    """A clip's log-mel [M, T] (T a multiple of the chunk) and its valid frames -> audio.onnx's inputs: the chunks
    grouped into windows of ``window_chunks`` (all of them when fewer), the last window padded with empty chunks."""
    frames = a.chunk_frames
    n = -(-valid // frames)  # chunks holding valid frames
    per = min(a.window_chunks, n)
    windows = -(-n // per)
    feats = np.zeros((windows * per, mel.shape[0], frames), np.float32)
    feats[:n] = mel[:, :n * frames].reshape(mel.shape[0], n, frames).transpose(1, 0, 2)
    lengths = np.zeros(windows * per, np.int64)
    lengths[:n] = np.minimum(frames, valid - frames * np.arange(n))
    rows = np.array([post_conv(int(v)) for v in lengths])  # valid rows per chunk
    k = a.chunk_tokens
    valid_slots = (np.arange(k)[None, :] < rows[:, None]).reshape(-1)  # [N K]
    return {"input_features": feats, "key_valid": valid_slots.reshape(windows, per * k),
            "token_slots": np.flatnonzero(valid_slots).astype(np.int64)}


@dataclass(frozen=True)
class EncoderKind:
    """What the runtime does for one encoder kind (models/audio.py SPECS): its log-mel settings and transform,
    and the audio.onnx feeds of a clip's features."""

    settings: type  # .from_dict(manifest.audio.features)
    log_mel: Callable[[np.ndarray, Any], tuple[np.ndarray, int]]  # (samples, settings) -> (mel, valid frames)
    feeds: Callable[[np.ndarray, int, Any], dict[str, np.ndarray]]  # (mel, valid, spec) -> audio.onnx's inputs


KINDS: dict[str, EncoderKind] = {
    "qwen3_asr": EncoderKind(MelSettings, features.log_mel, encoder_feeds),
    "gemma4": EncoderKind(features_gemma4.Gemma4MelSettings, features_gemma4.log_mel, conformer_feeds),
}


class Audio:
    """An artifact's audio graph, its log-mel settings and the embedding store it fills."""

    def __init__(self, session: Any, spec: Any, features: Any, token_id: int, store: ImageStore,
                 wrap: tuple[str, str] = ("", "")) -> None:
        self.session, self.spec, self.features = session, spec, features
        self.kind = KINDS[spec.encoder]
        self.token_id, self.store = token_id, store
        self.wrap = wrap  # the text around a clip's expanded tokens (Gemma 4: <|audio> .. <audio|>; LLM sets it)
        self.sampling_rate = features.sampling_rate
        self.placeholder = AUDIO_PAD  # the audio token's text (LLM sets it from the tokenizer)
        self.encode_seconds = 0.0  # the last clip encoded (bench/audio.py)

    @classmethod
    def attach(cls, backend: Any, manifest: Any) -> "Audio | None":
        """The artifact's audio path over ``backend`` (its prefill then reads the store, shared with images), or
        None for an artifact without audio.onnx or a backend whose prefill takes no embedding rows."""
        if manifest is None or manifest.audio is None or not getattr(backend, "takes_images", False):
            return None
        a = manifest.audio
        session = backend.open_graph(a.graph.file)
        if getattr(backend, "images", None) is None:
            backend.images = ImageStore()
        spec = audio_spec(dict(a.spec))
        return cls(session, spec, KINDS[spec.encoder].settings.from_dict(dict(a.features)),
                   int(manifest.model.images.token_id), backend.images)

    @property
    def wrap_ids(self) -> tuple[int | None, int | None]:
        """The ids of the tokens around a clip's (None: none), from the encoder's spec."""
        return getattr(self.spec, "begin_token_id", None), getattr(self.spec, "end_token_id", None)

    def embeddings(self, samples: np.ndarray) -> np.ndarray:
        """[A, hidden] audio embeddings of one clip at the model's rate (not stored)."""
        mel, valid = self.kind.log_mel(samples, self.features)
        if self.spec.tokens(valid) == 0:
            raise DecodertError(f"a clip of {np.asarray(samples).size} samples is too short to make one audio token")
        feeds = self.kind.feeds(mel, valid, self.spec)
        return self.session.run(["audio_embeds"], feeds)[0]

    def entry(self, samples: np.ndarray) -> _Entry:
        """The clip's embeddings and ids: from the store, else featurised and encoded now."""
        digest = clip_digest(samples, self.sampling_rate)
        entry = self.store.get(digest)
        if entry is None:
            t0 = time.perf_counter()
            embeds = self.embeddings(samples)
            entry = _Entry(image_ids(digest, self.token_id, len(embeds)), embeds, 1, len(embeds))
            self.store.put(digest, entry)
            self.encode_seconds = time.perf_counter() - t0
        return entry

    def prompt_ids(self, text: str, clips: Sequence[np.ndarray], encode: Callable[[str], np.ndarray]) -> np.ndarray:
        """The rendered prompt with one ``<|audio_pad|>`` per clip -> ids, each clip's tokens its audio ids
        (Qwen3ASRProcessor: the placeholder repeated once per encoder row; Gemma4Processor: those rows between
        ``wrap``'s begin and end tokens)."""
        mark = self.placeholder
        pieces = re.split("(" + re.escape(mark) + ")", text)
        marks = len(pieces) // 2
        if marks != len(clips):
            raise DecodertError(f"the prompt has {marks} {mark} placeholders for {len(clips)} audio clips "
                                "(the chat template places one per audio part)")
        entries = [self.entry(c) for c in clips]
        out = [pieces[0]]
        for entry, after in zip(entries, pieces[2::2]):
            out += [self.wrap[0] + mark * len(entry.ids) + self.wrap[1], after]
        ids = encode("".join(out)).copy()
        at = np.flatnonzero(ids == self.token_id)
        want = sum(len(e.ids) for e in entries)
        if len(at) != want:
            raise DecodertError(f"the prompt has {len(at)} audio tokens where its clips need {want}; "
                                f"does the text itself contain {mark}?")
        if want:
            ids[at] = np.concatenate([e.ids for e in entries])
        return ids
