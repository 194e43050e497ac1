"""Whisper: a seq2seq artifact (export/seq2seq_export.py) -> transcriptions, its graphs on ONNX Runtime (``OrtGraphs``)
or, after ``decodert build`` of a --target trt export, its engines on the trt backend (runtime/backends/trt/seq2seq.py).

    whisper = Whisper.open(folder, backend="ort")       # encoder.onnx + decoder.onnx + seq2seq.json (artifact/seq2seq.py)
    results = whisper.transcribe_many([clip, ...], language="en", max_new_tokens=64)   # [Transcript]
    results = whisper.transcribe_many([clip], timestamps=True)                         # .segments too

One clip: its log-mel (``frames``: padded to 30 s, or the whole clip's past 30 s) and a seek (frame 0 first); then
per round, all clips of a batch that have frames left together, transformers' sequential loop
(WhisperGenerationMixin.generate):
1. the 30 s window at each clip's seek (``window_at``, zero-padded past the clip's frames); encoder.onnx over the
   windows -> each decoder layer's cross K/V, written once into the rows' ``cache.cross`` buffers
   (KVCache.use_cross: a row's K/V always belong to the window whose cross K/V it holds; a row that holds this
   window's already, the same clip again, is not encoded again);
2. the forced prompt, as transformers' WhisperGenerationMixin._retrieve_init_tokens builds it:
   <|startoftranscript|>, the language (given, else detected once per clip on its first window: the decoder's
   logits after <|startoftranscript|> over the languages of lang_to_id, argmax), the task (given; <|transcribe|>
   when a language was given and the config has tasks; none after a detected one), <|notimestamps|> unless
   timestamps are asked for;
3. decoder.onnx over the prompt, then one token a step, the self-attention K/V bound in place and the cross K/V
   bound as they are (never recomputed per token); logits with begin_suppress_tokens at -inf at the first
   generated one, suppress_tokens at every step, then with timestamps the timestamp rules
   (runtime/audio/timestamps.py, WhisperTimeStampLogitsProcessor's); greedy; a row that wrote <|endoftext|> keeps
   stepping on it (transformers' padding) until every row is done;
4. each row's ids split at their timestamp pairs into segments (timestamps.split) and its seek moved to the first
   timestamp of the last pair (what follows is decoded again there) or past the window.

Without timestamps a clip of up to 30 s is one window (unless the model writes timestamp tokens after
<|notimestamps|>, which transformers splits on the same way); a longer clip, which transformers decodes with
timestamps only (``_set_return_timestamps``: return_timestamps=False raises past 30 s), is its consecutive windows
each decoded with <|notimestamps|>, their ids joined: what transformers' ``generate`` gives on each of those
windows (tests/audio/test_whisper.py). With timestamps short and long clips equal transformers' ``generate(...,
return_timestamps=True, return_segments=True)`` (tests/audio/test_whisper_timestamps.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from decodert.artifact.seq2seq import read_seq2seq
from decodert.errors import DecodertError
from decodert.models.families.whisper import WhisperSpec
from decodert.runtime.audio.features import MelSettings, log_mel
from decodert.runtime.audio.timestamps import Piece, TimestampRules, compression_ratio, log_softmax, split
from decodert.runtime.backends.kv_cache import KVCache
from decodert.runtime.backends.loading import seq2seq_backend

TO_CODE = {"english": "en", "german": "de", "french": "fr", "spanish": "es", "chinese": "zh", "japanese": "ja",
           "italian": "it", "portuguese": "pt", "russian": "ru", "korean": "ko", "dutch": "nl"}  # names beside codes


@dataclasses.dataclass(frozen=True)
class Transcript:
    """One clip's generated ids (every window's, joined; no <|endoftext|>) and why it stopped."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "stop": every window ended on <|endoftext|>; "length": one ran out of tokens
    language_id: int | None
    segments: tuple["Segment", ...] | None = None  # a timestamped run's: every window's, in order


@dataclasses.dataclass(frozen=True)
class Segment:
    """A timestamped segment: seconds from the clip's start, its ids (timestamps included), the mel frame its
    window started at, and that window's mean log-probability and compression ratio (timestamps.py)."""

    start: float
    end: float
    token_ids: tuple[int, ...]
    seek: int
    avg_logprob: float
    compression_ratio: float


class OrtGraphs:
    """encoder.onnx and decoder.onnx on ONNX Runtime (CPU), the caches on the host."""

    def __init__(self, folder: Path, record: dict, spec: WhisperSpec, max_batch: int, threads: int | None) -> None:
        import onnxruntime as ort

        from decodert.runtime.backends.ort_session import session_options

        options = session_options(threads)
        self.encoder = ort.InferenceSession(str(folder / record["graphs"]["encoder"]), options, providers=["CPUExecutionProvider"])
        self.decoder = ort.InferenceSession(str(folder / record["graphs"]["decoder"]), options, providers=["CPUExecutionProvider"])
        s = self.spec = spec
        self.cache = KVCache(max_batch, s.max_target_positions, s.decoder_layers, s.decoder_heads, s.head_dim,
                             np.float32, cross=[(f"cross_{k}.{i}", (s.decoder_heads, s.max_source_positions, s.head_dim))
                                                for i in range(s.decoder_layers) for k in ("key", "value")])

    def encode(self, windows: np.ndarray, slots: Sequence[int]) -> None:
        """encoder.onnx over ``windows`` [n, M, 2T]; window k's cross K/V into row ``slots[k]``."""
        outs = self.encoder.run(None, {"input_features": np.ascontiguousarray(windows, np.float32)})
        names = [o.name for o in self.encoder.get_outputs()]
        for k, slot in enumerate(slots):
            for j, name in enumerate(self.cache.cross_names):
                self.cache.cross[j][slot] = outs[names.index(name)][k]

    def step(self, start: int, ids: np.ndarray) -> np.ndarray:
        """decoder.onnx over rows [start, start + n) for ``ids`` [n, S] -> logits [n, V] (K/V written in place)."""
        import onnxruntime as ort

        n = ids.shape[0]
        io = self.decoder.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64))
        io.bind_cpu_input("past_lengths", np.array(self.cache.lengths[start:start + n], np.int64))
        for i in range(self.spec.decoder_layers):
            for j, kind in enumerate(("key", "value")):
                buf = ort.OrtValue.ortvalue_from_numpy(self.cache.buffers[2 * i + j][start:start + n])
                io.bind_ortvalue_input(f"past_{kind}.{i}", buf)
                io.bind_ortvalue_output(f"present_{kind}.{i}", buf)
        for j, name in enumerate(self.cache.cross_names):
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(self.cache.cross[j][start:start + n]))
        logits = np.empty((n, self.spec.vocab_size), np.float32)
        io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        self.decoder.run_with_iobinding(io)
        return logits

    def close(self) -> None:
        self.cache.free()


class Whisper:
    """An exported Whisper: its graphs on a backend (``OrtGraphs``, or the trt backend's engines:
    runtime/backends/trt/seq2seq.py), log-mel settings and generation config."""

    def __init__(self, folder: Path, record: dict, threads: int | None = None, backend: str = "ort") -> None:
        self.dir, self.record = folder, record
        self.spec = WhisperSpec.from_dict(record["spec"])
        self.features = MelSettings.from_dict(record["features"])
        self.window_samples = int(record["features"]["window_samples"])
        self.sampling_rate = self.features.sampling_rate
        self.gen = record["generation"]
        self.max_batch = int(record["max_batch"])
        self.backend = seq2seq_backend(folder, record, backend)
        if self.backend == "trt":
            from decodert.runtime.backends.trt.seq2seq import TrtSeq2seq

            self.graphs: Any = TrtSeq2seq(folder, record, self.spec, self.max_batch)
        else:
            self.graphs = OrtGraphs(folder, record, self.spec, self.max_batch, threads)
        self.cache: KVCache = self.graphs.cache
        self.encode_seconds = 0.0

    @classmethod
    def open(cls, folder: str | Path, verify: str = "fast", threads: int | None = None,
             backend: str = "ort") -> "Whisper":
        folder = Path(folder)
        return cls(folder, read_seq2seq(folder, verify), threads, backend)

    def close(self) -> None:
        self.graphs.close()

    # -- features --------------------------------------------------------------------------------
    def frames(self, samples: np.ndarray) -> np.ndarray:
        """[M, F] float32 log-mel of one clip at the model's rate: padded to 30 s of samples for a clip no longer
        (WhisperFeatureExtractor's default; F = one window), else the whole clip's (one maximum for the log floor;
        F its frames: the extractor with truncation=False, padding="longest")."""
        x = np.asarray(samples, np.float32).reshape(-1)
        if x.size <= self.window_samples:
            mel, _ = log_mel(x, self.features, pad_to=self.window_samples)
            return mel[:, :self.spec.window_frames]
        mel, valid = log_mel(x, self.features)
        return mel[:, :valid]

    def window_at(self, mel: np.ndarray, seek: int) -> tuple[np.ndarray, int]:
        """The window [M, 2T] of ``mel`` starting at frame ``seek``, zero-padded past its end (transformers'
        long-form ``_get_input_segment``), and how many of its frames are the clip's."""
        frames = self.spec.window_frames
        part = mel[:, seek:seek + min(mel.shape[1] - seek, frames)]
        out = np.zeros((mel.shape[0], frames), np.float32)
        out[:, :part.shape[1]] = part
        return out, part.shape[1]

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """[W, M, 2T] float32 log-mel windows of one clip: ``frames`` cut into consecutive windows, the last
        zero-padded (what a run without timestamps decodes)."""
        mel = self.frames(samples)
        step = self.spec.window_frames
        return np.stack([self.window_at(mel, at)[0] for at in range(0, mel.shape[1], step)])

    # -- the forced prompt -------------------------------------------------------------------------
    def language_id(self, language: str | None) -> int | None:
        """A language code, name or token (<|en|>) -> its token id; None: none given."""
        if language is None or language == "":
            return None
        if not isinstance(language, str):
            raise DecodertError(f"language must be a string, got {type(language).__name__}")
        table = self.gen["lang_to_id"]
        if not table:
            raise DecodertError("this Whisper model is English-only: it takes no language")
        key = language.lower()
        token = key if key in table else f"<|{TO_CODE.get(key, key)}|>"
        if token not in table:
            codes = ", ".join(sorted(t.strip("<|>") for t in table))
            raise DecodertError(f"language {language!r} is not one this model knows ({codes})")
        return table[token]

    def prompt(self, language: int | None, task: str | None, given: bool = True, timestamps: bool = False) -> list[int]:
        """The forced prompt; <|transcribe|> is implied by a ``given`` language only (a detected one adds no task,
        as in transformers); <|notimestamps|> last unless ``timestamps``."""
        ids = [int(self.gen["decoder_start_token_id"])]
        if language is not None:
            ids.append(language)
        tasks = self.gen["task_to_id"]
        if task is not None:
            if task not in tasks:
                raise DecodertError(f"task {task!r} is not one of {', '.join(sorted(tasks)) or 'none (no tasks)'}")
            ids.append(tasks[task])
        elif language is not None and given and "transcribe" in tasks:
            ids.append(tasks["transcribe"])
        if self.gen.get("no_timestamps_token_id") is not None and not timestamps:
            ids.append(int(self.gen["no_timestamps_token_id"]))
        return ids

    # -- graphs ------------------------------------------------------------------------------------
    def encode(self, windows: np.ndarray, slots: Sequence[int], tags: Sequence[bytes]) -> int:
        """Give each of ``slots`` the cross K/V of its window (``windows`` [n, M, 2T], named by ``tags``): encoder.onnx
        runs over the windows whose rows do not hold them already (KVCache.use_cross) -> how many it encoded."""
        todo = [r for r, (slot, tag) in enumerate(zip(slots, tags)) if self.cache.use_cross(slot, tag)]
        self.encode_seconds = 0.0
        if not todo:
            return 0
        t0 = time.perf_counter()
        self.graphs.encode(windows[todo], [slots[r] for r in todo])
        self.encode_seconds = time.perf_counter() - t0
        return len(todo)

    def step(self, start: int, ids: np.ndarray) -> np.ndarray:
        """decoder.onnx over rows [start, start + n) for ``ids`` [n, S] (every row at the same length) -> logits
        [n, V]; the new K/V are written into the cache in place and committed."""
        n, width = ids.shape
        rows = list(range(start, start + n))
        self.cache.check_room(rows, [width] * n, "the decoder's tokens (max_target_positions)")
        logits = self.graphs.step(start, ids)
        self.cache.commit(rows, ids)
        return logits

    # -- generation --------------------------------------------------------------------------------
    def transcribe_many(self, clips: Sequence[np.ndarray], language: str | None = None, task: str | None = None,
                        max_new_tokens: int | None = None, timestamps: bool = False) -> list[Transcript]:
        """Greedy transcriptions of ``clips`` (float32 at the model's rate), up to ``max_batch`` at a time;
        ``timestamps``: the timestamped decode and its segments (runtime/audio/timestamps.py)."""
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise DecodertError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(timestamps, bool):
            raise DecodertError(f"timestamps must be true or false, got {timestamps!r}")
        lang = self.language_id(language)
        if task is not None and lang is None and not self.gen["lang_to_id"]:
            raise DecodertError("this Whisper model is English-only: it takes no task")
        rules = TimestampRules.of(self.gen, self.spec.vocab_size) if timestamps else None
        out: list[Transcript] = []
        for at in range(0, len(clips), self.max_batch):
            part = list(clips[at:at + self.max_batch])
            out += self._decode(part, lang, task, max_new_tokens, rules)
        return out

    def _decode(self, clips: list[np.ndarray], lang: int | None, task: str | None, max_new_tokens: int | None,
                rules: TimestampRules | None) -> list[Transcript]:
        """transformers' sequential decode (WhisperGenerationMixin.generate): a window at each clip's ``seek`` (frame
        0 first), decoded (under the timestamp rules when ``rules``), split at its timestamp pairs (timestamps.split),
        the seek moved to the last complete pair or past the window; until every clip's seek passes its frames. A
        clip's ids are its segments' ids joined (what follows the last pair of a window is decoded again from there).
        Without ``rules`` transformers splits the same way on any timestamp tokens the model writes after
        <|notimestamps|>; a clip over 30 s, which transformers decodes with timestamps only, is then its consecutive
        windows joined, every id kept."""
        mels = [self.frames(c) for c in clips]
        seek = [0] * len(clips)
        stride = self.spec.window_frames // self.spec.max_source_positions  # mel frames per encoder position (2)
        nots = self.gen.get("no_timestamps_token_id")
        begin = rules.begin if rules is not None else self.spec.vocab_size + 1 if nots is None else int(nots) + 1
        eos = int(self.gen["eos_token_id"])
        segments: list[list[Segment]] = [[] for _ in clips]
        reasons = ["stop"] * len(clips)
        langs: list[int | None] = [lang] * len(clips)
        max_length = int(self.gen["max_length"])
        first = True
        while any(at < mel.shape[1] for at, mel in zip(seek, mels)):
            rows = [r for r, mel in enumerate(mels) if seek[r] < mel.shape[1]]  # clips with a window here, in order
            cut = [self.window_at(mels[r], seek[r]) for r in rows]
            windows = np.stack([w for w, _ in cut])
            self.encode(windows, list(range(len(rows))), [_digest(w) for w in windows])
            if first and lang is None and self.gen["lang_to_id"]:
                detected = self._detect(len(rows))
                for k, r in enumerate(rows):
                    langs[r] = detected[k]
            first = False
            prompts = [self.prompt(langs[r], task, lang is not None, timestamps=rules is not None) for r in rows]
            width = len(prompts[0])
            if max_new_tokens is None:  # transformers raises generation_config.max_length by the prompt each window
                max_length = min(max_length + min(self.spec.max_target_positions // 2 - 1, width),
                                 self.spec.max_target_positions)
            budget = self._budget(width, max_new_tokens, max_length)
            for (r, (_, frames)), window in zip(zip(rows, cut), self._generate(prompts, budget, rules)):
                if rules is None and mels[r].shape[1] > self.spec.window_frames:
                    pieces, advance = [Piece(0.0, 0.0, tuple(window.ids))], frames
                else:
                    pieces, advance = split(window.ids, begin, seek[r], frames, stride)
                ratio = compression_ratio(window.ids + ([eos] if window.reason == "stop" else []), self.spec.vocab_size)
                segments[r] += [Segment(p.start, p.end, p.token_ids, seek[r], window.avg_logprob, ratio) for p in pieces]
                seek[r] += advance
                if window.reason == "length":
                    reasons[r] = "length"
        return [Transcript(tuple(t for s in segs for t in s.token_ids), why, lg,
                           tuple(segs) if rules is not None else None)
                for segs, why, lg in zip(segments, reasons, langs)]

    def _detect(self, n: int) -> list[int]:
        """transformers' detect_language: the decoder's logits after <|startoftranscript|>, argmax over the
        languages."""
        for r in range(n):
            self.cache.reset(r)
        logits = self.step(0, np.full((n, 1), int(self.gen["decoder_start_token_id"]), np.int64))
        table = np.array(sorted(self.gen["lang_to_id"].values()), np.int64)
        return [int(table[np.argmax(row[table])]) for row in logits]

    def _budget(self, width: int, max_new_tokens: int | None, max_length: int | None = None) -> int:
        """The tokens a window may generate after its ``width``-token prompt: ``max_new_tokens``, else transformers'
        default (max_length plus the prompt's tokens, at most max_target_positions, less the prompt)."""
        limit = self.spec.max_target_positions
        if max_new_tokens is None:
            if max_length is None:
                max_length = min(int(self.gen["max_length"]) + min(limit // 2 - 1, width), limit)
            return max_length - width
        if width + max_new_tokens > limit:
            raise DecodertError(f"max_new_tokens {max_new_tokens} and the {width}-token prompt exceed the model's "
                                f"max_target_positions {limit}")
        return max_new_tokens

    def _generate(self, prompts: list[list[int]], budget: int, rules: TimestampRules | None = None) -> list[Decoded]:
        """Rows 0..n-1 (their cross K/V written) from their prompts (one length), up to ``budget`` tokens each ->
        per row its ids without eos, why it stopped and the mean log-probability of its tokens (eos included) under
        the logits as constrained. Per step: suppress_tokens, begin_suppress_tokens at the first, the timestamp
        rules when given, greedy."""
        n = len(prompts)
        eos = int(self.gen["eos_token_id"])
        suppress = np.array(self.gen["suppress_tokens"], np.int64)
        begin = np.array(self.gen["begin_suppress_tokens"], np.int64)
        for r in range(n):
            self.cache.reset(r)
        logits = self.step(0, np.array(prompts, np.int64))
        out: list[list[int]] = [[] for _ in range(n)]
        done = np.zeros(n, bool)
        logp = np.zeros(n, np.float64)
        count = np.zeros(n, np.int64)
        for step in range(max(budget, 0)):
            logits[:, suppress] = -np.inf
            if step == 0:
                logits[:, begin] = -np.inf
            if rules is not None:
                rules.constrain(logits, [out[r] + [eos] * (step - len(out[r])) for r in range(n)])
            nxt = np.where(done, eos, np.argmax(logits, axis=-1))
            with np.errstate(invalid="ignore", divide="ignore"):
                chosen = log_softmax(logits)[np.arange(n), nxt]
            for r in np.flatnonzero(~done):
                logp[r] += chosen[r]
                count[r] += 1
                if nxt[r] == eos:
                    done[r] = True
                else:
                    out[r].append(int(nxt[r]))
            if done.all() or step == budget - 1:
                break
            logits = self.step(0, nxt[:, None].astype(np.int64))
        return [Decoded(ids, "stop" if d else "length", float(lp / c) if c else 0.0)
                for ids, d, lp, c in zip(out, done, logp, count)]


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One row of one window: its ids (no eos), "stop" (eos) or "length", its tokens' mean log-probability."""

    ids: list[int]
    reason: str
    avg_logprob: float


def _digest(window: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(window).data, digest_size=16, person=b"decodert-window").digest()

TEXT_REFUSED = ("a Whisper artifact transcribes audio (transcribe, /v1/audio/transcriptions); it does not generate "
                "from text, chat or embed")


class WhisperLLM:
    """What ``LLM.load`` returns for a seq2seq artifact: ``transcribe`` / ``transcribe_many`` (GenerationResult,
    as LLM.transcribe), the tokenizer, the audio limits; chat and text generation are refused in one line."""

    def __init__(self, folder: str | Path, verify: str = "fast", threads: int | None = None,
                 backend: str = "ort") -> None:
        from tokenizers import Tokenizer

        from decodert.runtime.audio.clips import DEFAULT_AUDIO_LIMITS

        self.model = Whisper.open(folder, verify, threads, backend)
        self.tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        from types import SimpleNamespace

        from decodert.runtime.adapters import Adapters

        self.audio_limits = DEFAULT_AUDIO_LIMITS
        self.sampling_rate = self.model.sampling_rate
        self.manifest = None
        self.lock = threading.Lock()  # one transcription at a time over the one cache (the server's threads)
        # what the server's engine thread and /metrics read of an LLM: no text engine, nothing cached between requests
        self.backend = SimpleNamespace(max_batch=self.model.max_batch, max_seq=self.model.spec.max_target_positions,
                                       placement=None)
        self.max_seq = self.model.spec.max_target_positions
        self.slots_in_use, self.prefix_cache, self.adapters = 0, None, Adapters(None, None, None)

    def transcribe(self, audio: Any, sample_rate: int | None = None, language: str | None = None,
                   prompt: str | None = None, task: str | None = None, **params: Any) -> Any:
        """Speech to text (LLM.transcribe's signature): ``audio`` a path, encoded bytes, or samples with
        ``sample_rate``; ``language`` forces it (else detected); ``max_new_tokens`` per 30 s window;
        ``timestamps=True``: the timestamped decode, its segments in GenerationResult.segments (start, end, text,
        token ids) and its ids, timestamp tokens included, in token_ids (transformers' ``generate(...,
        return_timestamps=True)``)."""
        return self.transcribe_many([audio], sample_rate, language, prompt, task, **params)[0]

    def transcribe_many(self, clips: Sequence[Any], sample_rate: int | None = None, language: str | None = None,
                        prompt: str | None = None, task: str | None = None, **params: Any) -> list[Any]:
        from decodert.runtime.audio.clips import load_audio
        from decodert.runtime.decoding.generate import GenerationResult, TranscriptSegment
        from decodert.runtime.decoding.metrics import Metrics

        if prompt is not None:
            raise DecodertError("prompt (previous text for Whisper's <|startofprev|>) is not supported yet")
        max_new_tokens = params.pop("max_new_tokens", None)
        timestamps = params.pop("timestamps", None)
        timestamps = False if timestamps is None else timestamps
        temperature = params.pop("temperature", 0.0)
        if temperature not in (0, 0.0, None):
            raise DecodertError("Whisper transcribes greedily here: temperature must be 0")
        given = sorted(k for k, v in params.items() if v not in (None, (), [], {}, False))  # the CLI passes its defaults
        if given:
            raise DecodertError(f"transcription parameter {given[0]!r} is not supported for Whisper "
                                "(max_new_tokens, temperature 0, language, task, timestamps)")
        samples = [load_audio(c, f"audio {i}", self.audio_limits, self.sampling_rate, sample_rate)
                   for i, c in enumerate(clips)]
        t0 = time.perf_counter()
        with self.lock:
            found = self.model.transcribe_many(samples, language, task, max_new_tokens, timestamps)
        total = time.perf_counter() - t0
        out = []
        for t in found:
            ids = list(t.token_ids)
            metrics = Metrics(ttft_s=0.0, prompt_tokens=0, prompt_tps=0.0, generated_tokens=len(ids), decode_tps=0.0,
                              tpot_ms=0.0, peak_rss_mb=0.0, total_s=total)
            segments = None if t.segments is None else [
                TranscriptSegment(s.start, s.end, self.text(s.token_ids), list(s.token_ids), s.seek, s.avg_logprob,
                                  s.compression_ratio) for s in t.segments]
            out.append(GenerationResult(self.text(ids), ids, t.finish_reason, metrics, segments=segments))
        return out

    @property
    def has_timestamps(self) -> bool:
        """Whether the vocabulary has timestamp tokens (after <|notimestamps|>): ``timestamps=True`` works."""
        nots = self.model.gen.get("no_timestamps_token_id")
        return nots is not None and int(nots) + 1 < self.model.spec.vocab_size

    def text(self, ids: Sequence[int]) -> str:
        """The text of ``ids``: special tokens and timestamp tokens (a checkpoint's tokenizer may not mark those
        special) left out."""
        nots = self.model.gen.get("no_timestamps_token_id")
        kept = [int(t) for t in ids if nots is None or int(t) <= int(nots)]
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    def language_name(self, language_id: int | None) -> str | None:
        return None if language_id is None else self.tokenizer.id_to_token(language_id).strip("<|>")

    fetch_image = None  # no image parts (the server's Messages route reads it)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise DecodertError(TEXT_REFUSED)

    chat = stream = prepare = params = generate  # params / prepare: what the server's text routes call first

    @property
    def embedder(self) -> Any:
        raise DecodertError(TEXT_REFUSED)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
        self.model = None  # type: ignore[assignment]
