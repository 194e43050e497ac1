"""Whisper's timestamp tokens: the rules a timestamped decode follows at each step, and how a window's ids become
segments and the next window's start (runtime/audio/whisper.py runs them).

The vocabulary: <|notimestamps|> and right after it the timestamp tokens <|0.00|> .. <|30.00|>, one per decoder
position step (0.02 s; ``begin`` = no_timestamps_token_id + 1 is <|0.00|>). Per step, on the logits [n, V] after
suppress_tokens / begin_suppress_tokens (the order transformers' WhisperTimeStampLogitsProcessor runs in):

    <|notimestamps|>                        never
    last two generated were timestamps      no timestamp now (a pair closed a segment: text or eos follows)
    last one was, the one before was not    no text now (ids below eos): the pair's second timestamp, or eos
    a timestamp below the last one          never (and not the last one again unless it closes a pair)
    the first generated token               a timestamp, at most begin + max_initial_timestamp_index
    P(any timestamp) > P(best other token)  a timestamp (the summed probability mass of the timestamps wins)

A window's ids split into segments at each pair of consecutive timestamps (``split``): <|a|> text <|b|><|b'|>
text ... ; a window that ends on text is cut at its last complete pair, and the next window starts at that pair's
first timestamp (the seek), its words after it decoded again there; a window that ends on one timestamp, or has no
pair, is one piece through its end, and the next window starts where it ends. This is transformers'
WhisperGenerationMixin._retrieve_segment, with its float arithmetic (float64 times, a float32 frame count).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Sequence

import numpy as np

from decodert.errors import DecodertError

TIME_STEP = 0.02  # seconds per timestamp token (30 s over 1500 encoder positions): transformers' time_precision
FRAME_STEP = 0.01  # seconds per mel frame (hop 160 at 16 kHz): transformers' time_precision_features


@dataclasses.dataclass(frozen=True)
class TimestampRules:
    """The ids the rules read: ``begin`` (<|0.00|>), <|notimestamps|>, <|endoftext|>, the first token's cap."""

    begin: int
    no_timestamps: int
    eos: int
    max_initial: int | None  # generation_config max_initial_timestamp_index (None: no cap)

    @classmethod
    def of(cls, gen: dict, vocab_size: int) -> "TimestampRules":
        """From an artifact's generation record; a model without timestamp tokens is refused in one line."""
        nots = gen.get("no_timestamps_token_id")
        if nots is None or int(nots) + 1 >= vocab_size:
            raise DecodertError("this Whisper model has no timestamp tokens (none after <|notimestamps|> in its "
                                "vocabulary): timestamps are not available")
        if "max_initial_timestamp_index" not in gen:
            raise DecodertError("this Whisper artifact predates timestamps (its seq2seq.json has no "
                                "max_initial_timestamp_index): export it again")
        cap = gen["max_initial_timestamp_index"]
        return cls(int(nots) + 1, int(nots), int(gen["eos_token_id"]), None if cap is None else int(cap))

    def constrain(self, logits: np.ndarray, generated: Sequence[Sequence[int]]) -> None:
        """Apply the rules in place to ``logits`` [n, V] (float32), row k having generated ``generated[k]`` after the
        prompt (every row as many ids)."""
        b = self.begin
        logits[:, self.no_timestamps] = -np.inf
        for k, seq in enumerate(generated):
            last = len(seq) >= 1 and seq[-1] >= b
            before = len(seq) < 2 or seq[-2] >= b
            if last:
                if before:
                    logits[k, b:] = -np.inf
                else:
                    logits[k, :self.eos] = -np.inf
            floor = b
            stamps = [t for t in seq if t >= b]
            if stamps:
                floor = stamps[-1] if last and not before else stamps[-1] + 1
            logits[k, b:floor] = -np.inf
        if generated and not generated[0]:
            logits[:, :b] = -np.inf
            if self.max_initial is not None:
                logits[:, b + self.max_initial + 1:] = -np.inf
        with np.errstate(invalid="ignore", divide="ignore"):
            logp = log_softmax(logits)
            mass = _logsumexp(logp[:, b:])
            best = logp[:, :b].max(axis=-1)
        logits[mass > best, :b] = -np.inf


@dataclasses.dataclass(frozen=True)
class Piece:
    """One segment of a window: its times (seconds from the clip's start) and ids (timestamps included)."""

    start: float
    end: float
    token_ids: tuple[int, ...]


def split(ids: Sequence[int], begin: int, seek: int, frames: int, stride: int) -> tuple[list[Piece], int]:
    """A window's generated ids (no eos) at mel frame ``seek``, ``frames`` of it real audio (at most a window), the
    encoder's ``stride`` (mel frames per position) -> (its segments, how many frames the next window starts on)."""
    ids = [int(t) for t in ids]
    stamp = [t >= begin for t in ids]
    offset = seek * TIME_STEP / stride
    single_end = stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(ids) - 1) if stamp[i] and stamp[i + 1]]
    if not cuts:
        end = int(np.float32(frames) * np.float32(FRAME_STEP) / np.float32(TIME_STEP))  # torch: a long tensor * float
        last = [i for i, s in enumerate(stamp) if s]
        if last and ids[last[-1]] != begin:
            end = ids[last[-1]] - begin
        return [Piece(offset, offset + float(end) * TIME_STEP, tuple(ids))], frames
    if single_end:
        cuts.append(len(ids))
    else:
        cuts[-1] += 1  # the closing pair's second timestamp stays with the last segment
    pieces, at = [], 0
    for i, cut in enumerate(cuts):
        part = ids[at:cut]
        tail = -2 if i == len(cuts) - 1 and not single_end else -1
        pieces.append(Piece(offset + float(part[0] - begin) * TIME_STEP, offset + float(part[tail] - begin) * TIME_STEP,
                            tuple(part)))
        at = cut
    if single_end:
        return pieces, frames
    step = (ids[at - 2] - begin) * stride  # the start of the last pair: what follows it is decoded again
    return pieces, step if step > 0 else frames


def compression_ratio(ids: Sequence[int], vocab_size: int) -> float:
    """Raw over zlib-compressed bytes of the ids (transformers' _retrieve_compression_ratio: each id little-endian
    in the bytes the vocabulary needs): high for a window that repeats itself."""
    width = int(math.log2(vocab_size) / 8) + 1
    raw = b"".join(int(t).to_bytes(width, "little") for t in ids)
    return len(raw) / len(zlib.compress(raw))


def log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    shifted = x - top
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    return (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))[:, 0]
