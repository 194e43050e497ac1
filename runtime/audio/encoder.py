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
from decodert.models.audio import AudioSpec, audio_spec, post_conv, whisper_rows
from decodert.runtime.audio import features_gemma4
from decodert.runtime.audio.conformer import conformer_feeds
from decodert.runtime.audio.features import MelSettings, log_mel
from decodert.runtime.vision.encoder import ImageStore, _Entry
from decodert.runtime.vision.tokens import image_ids

AUDIO_PAD = "<|audio_pad|>"  # the placeholder a Qwen3-ASR chat template writes per audio part


def clip_digest(samples: np.ndarray, rate: int) -> bytes:
    """16 bytes naming a clip by its rate and float32 samples."""
    h = hashlib.blake2b(digest_size=16, person=b"decodert-audio")
    h.update(np.asarray([rate, samples.size], np.int64).tobytes())
    h.update(np.ascontiguousarray(samples, np.float32).data)
    return h.digest()


def encoder_feeds(mel: np.ndarray, valid: int, a: Any) -> dict[str, np.ndarray]:
    """A clip's log-mel and its valid frames -> audio.onnx's inputs, as ``a``'s encoder kind reads them."""
    return FEEDS[a.encoder].feeds(mel, valid, a)


def chunk_feeds(mel: np.ndarray, valid: int, a: AudioSpec) -> dict[str, np.ndarray]:
    """``qwen3_asr``: the log-mel (T a multiple of the chunk) cut into chunks grouped into windows of
    ``window_chunks`` (all of them when fewer), the last window padded with empty chunks."""
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


def window_feeds(mel: np.ndarray, valid: int, a: AudioSpec) -> dict[str, np.ndarray]:
    """``whisper`` (export/lowering/audio/whisper.py): the first F = 2 R frames of the 30 s window, R >= n + 1
    rows (even, at most max_positions) for the n = (valid - 1) // 2 + 1 rows the clip has, the pooled rows of its
    n // 2 tokens. A clip longer than the window is refused (Qwen2AudioProcessor would cut it at 30 s)."""
    if mel.shape[1] > a.window_frames:
        raise DecodertError(f"an audio clip of {mel.shape[1]} mel frames is longer than the {a.window_frames} (one "
                            "30 s window) this model's audio encoder reads; split it into shorter clips")
    rows = whisper_rows(valid)
    kept = min(rows + (1 if rows % 2 else 2), a.max_positions)  # R: even, past the last valid row
    return {"input_features": np.ascontiguousarray(mel[None, :, :2 * kept], np.float32),
            "key_valid": (np.arange(kept) < rows)[None, :],
            "token_slots": np.arange(a.tokens(valid), dtype=np.int64)}


@dataclass(frozen=True)
class Feeds:
    """What the runtime does for one encoder kind: a clip's log-mel (its settings' type and transform) and the
    audio.onnx feeds of it."""

    feeds: Callable[[np.ndarray, int, Any], dict[str, np.ndarray]]  # (mel, valid frames, spec) -> audio.onnx's inputs
    settings: type = MelSettings  # .from_dict(manifest.audio.features)
    log_mel: Callable[[np.ndarray, Any], tuple[np.ndarray, int]] = log_mel  # (samples, settings) -> (mel, valid)


FEEDS: dict[str, Feeds] = {  # encoder kind (models/audio.py KINDS) -> its features and feeds
    "qwen3_asr": Feeds(chunk_feeds),
    "whisper": Feeds(window_feeds),
    "gemma4": Feeds(conformer_feeds, features_gemma4.Gemma4MelSettings, features_gemma4.log_mel),  # mel [T, M]
}


class Audio:
    """An artifact's audio graph, its log-mel settings and the embedding store it fills."""

    def __init__(self, session: Any, spec: Any, features: Any, token_id: int, store: ImageStore,
                 wrap: tuple[str, str] = ("", "")) -> None:
        self.session, self.spec, self.features = session, spec, features
        self.kind = FEEDS[spec.encoder]
        self.token_id, self.store = token_id, store
        self.wrap = wrap  # the text around a clip's expanded tokens (Gemma 4: <|audio> .. <audio|>; LLM sets it)
        self.sampling_rate = features.sampling_rate
        self.placeholder = AUDIO_PAD  # the audio token's text (LLM sets it from the tokenizer)
        self.encode_seconds = 0.0  # the last clip encoded (bench/audio.py)
        self.transcription: dict | None = None  # the manifest's audio.transcription (runtime/audio/transcribe.py)

    @classmethod
    def attach(cls, backend: Any, manifest: Any) -> "Audio | None":
        """The artifact's audio path over ``backend`` (its prefill then reads the store, shared with images), or
        None for an artifact without audio.onnx or a backend that does not run it with its prefill taking the rows
        (``takes_audio``). The graph runs on the backend's own runner when it has one (trt: audio.engine), else on
        ONNX Runtime."""
        if manifest is None or manifest.audio is None or not getattr(backend, "takes_audio", False):
            return None
        a = manifest.audio
        session = getattr(backend, "audio", None)
        if session is None:
            session = backend.open_graph(a.graph.file)
        if getattr(backend, "images", None) is None:
            backend.images = ImageStore()
        spec = audio_spec(dict(a.spec))
        audio = cls(session, spec, FEEDS[spec.encoder].settings.from_dict(dict(a.features)),
                    int(manifest.model.images.token_id), backend.images)
        audio.transcription = dict(a.transcription) if a.transcription is not None else None
        return audio

    @property
    def wrap_ids(self) -> tuple[int | None, int | None]:
        """The ids of the tokens around a clip's (None: none), from the encoder's spec."""
        return getattr(self.spec, "begin_token_id", None), getattr(self.spec, "end_token_id", None)

    def embeddings(self, samples: np.ndarray) -> np.ndarray:
        """[A, hidden] audio embeddings of one clip at the model's rate (not stored)."""
        most = getattr(self.features, "max_samples", None)  # an extractor that truncates (Gemma 4's: 30 s)
        if most is not None and np.asarray(samples).size > most:
            raise DecodertError(f"an audio clip of {np.asarray(samples).size / self.features.sampling_rate:.2f} s is "
                                f"longer than the {most / self.features.sampling_rate:g} s this model's audio encoder "
                                "reads (its processor would cut it); split it into shorter clips")
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
