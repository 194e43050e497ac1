"""Audio in: a clip from a path, bytes, a base64 string / data URL or a (samples, sample_rate) pair -> mono float32
samples at the model's rate, under limits (each breach one DecodertError line).

    clip = load_audio(source, "message 0 audio 1", DEFAULT_AUDIO_LIMITS, 16000, sample_rate=None)

Files are decoded by soundfile (libsndfile: WAV, FLAC, OGG, MP3 where the library has it), the channels
averaged (what transformers' audio loading does), then resampled to the model's rate by ``resample_poly``: the
polyphase FIR resampler of scipy.signal.resample_poly (Kaiser-windowed sinc, beta 5, 10 zero crossings per
side of the slower rate), written here in numpy so the runtime needs no scipy; tests compare the two.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError

FORMATS = ("wav", "flac", "ogg", "mp3")  # what an input_audio part's "format" may name (soundfile reads them)


@dataclass(frozen=True)
class AudioLimits:
    """What one request may send: encoded bytes per clip, seconds per clip, clips per request."""

    max_bytes: int = 25 * 1024 * 1024  # OpenAI's transcription upload limit
    max_seconds: float = 600.0
    max_clips: int = 8


DEFAULT_AUDIO_LIMITS = AudioLimits()


def load_audio(source: Any, what: str, limits: AudioLimits, rate: int, sample_rate: int | None = None) -> np.ndarray:
    """``source``: a path, bytes, a base64 string or data:audio/...;base64 URL, a (samples, sample_rate) pair, or a
    float array with ``sample_rate`` -> [n] float32 at ``rate`` Hz."""
    if isinstance(source, tuple) and len(source) == 2 and not isinstance(source[1], (np.ndarray, list)):
        source, sample_rate = source
    if isinstance(source, (np.ndarray, list)):
        if sample_rate is None:
            raise DecodertError(f"{what}: an array of samples needs its sample_rate ((samples, rate) or sample_rate=)")
        samples = np.asarray(source)
        if samples.dtype.kind not in "fiu" or samples.ndim not in (1, 2) or samples.size == 0:
            raise DecodertError(f"{what}: samples must be a non-empty [n] or [n, channels] numeric array")
        if samples.dtype.kind in "iu":  # integer PCM -> [-1, 1)
            samples = samples.astype(np.float64) / float(2 ** (8 * samples.dtype.itemsize - 1))
        return _finish(samples, int(sample_rate), what, limits, rate)
    data = _bytes(source, what, limits)
    try:
        import soundfile
    except ImportError:
        raise DecodertError("decoding audio files needs soundfile: pip install 'decodert[audio]'") from None
    try:
        samples, file_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except Exception as e:  # soundfile.LibsndfileError and friends: not a readable audio file
        raise DecodertError(f"{what}: not a readable audio file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if np.asarray(samples).size == 0:
        raise DecodertError(f"{what}: the audio file holds no samples")
    return _finish(samples, int(file_rate), what, limits, rate)


def _bytes(source: Any, what: str, limits: AudioLimits) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, Path) or (isinstance(source, str) and not _looks_encoded(source)):
        path = Path(source)
        if not path.is_file():
            raise DecodertError(f"{what}: no audio file {str(path)!r}")
        if path.stat().st_size > limits.max_bytes:
            raise DecodertError(f"{what}: the audio file is {path.stat().st_size} bytes; the limit is {limits.max_bytes}")
        data = path.read_bytes()
    elif isinstance(source, str):
        text = source.split(",", 1)[1] if source.startswith("data:") else source
        if len(text) * 3 // 4 > limits.max_bytes:
            raise DecodertError(f"{what}: the audio is over {limits.max_bytes} bytes (the limit)")
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise DecodertError(f"{what}: audio data is not valid base64") from None
    else:
        raise DecodertError(f"{what}: audio must be a path, bytes, base64 data or (samples, sample_rate), "
                            f"got {type(source).__name__}")
    if len(data) > limits.max_bytes:
        raise DecodertError(f"{what}: the audio is {len(data)} bytes; the limit is {limits.max_bytes}")
    return data


def _looks_encoded(s: str) -> bool:
    """A data URL, or a long string with no path separator (base64 of a file is never a short path)."""
    return s.startswith("data:") or (len(s) > 512 and "/" not in s[:64] and "\\" not in s[:64])


def _finish(samples: np.ndarray, file_rate: int, what: str, limits: AudioLimits, rate: int) -> np.ndarray:
    x = np.asarray(samples, np.float64)
    if x.ndim == 2:
        x = x.mean(axis=1)  # channels averaged
    if file_rate <= 0:
        raise DecodertError(f"{what}: sample rate {file_rate} must be positive")
    seconds = x.size / file_rate
    if seconds > limits.max_seconds:
        raise DecodertError(f"{what}: the clip is {seconds:.1f} s long; the limit is {limits.max_seconds:g} s")
    if not np.isfinite(x).all():
        raise DecodertError(f"{what}: the samples hold NaN or infinity")
    if file_rate != rate:
        x = resample_poly(x, rate, file_rate)
    return x.astype(np.float32)


def _kaiser_lowpass(taps: int, cutoff: float) -> np.ndarray:
    """scipy.signal.firwin(taps, cutoff, window=("kaiser", 5.0)): a windowed sinc with unit gain at DC."""
    m = np.arange(taps) - (taps - 1) / 2
    h = cutoff * np.sinc(cutoff * m) * np.kaiser(taps, 5.0)
    return h / h.sum()


def resample_poly(x: np.ndarray, up: int, down: int) -> np.ndarray:
    """[n] float64 -> [ceil(n * up / down)]: upsample by ``up``, low-pass, keep every ``down``-th sample, as
    scipy.signal.resample_poly(x, up, down) with its default window and zero padding."""
    g = math.gcd(up, down)
    up, down = up // g, down // g
    x = np.asarray(x, np.float64)
    if up == down == 1:
        return x.copy()
    n_in = x.size
    n_out = n_in * up // down + bool(n_in * up % down)
    half = 10 * max(up, down)
    h = _kaiser_lowpass(2 * half + 1, 1.0 / max(up, down)) * up
    pre = down - half % down
    skip = (half + pre) // down  # outputs of the filter's delay, dropped
    h = np.concatenate([np.zeros(pre), h])
    # y[i] = sum_m h[t - m up] x[m] with t = (i + skip) down: output i reads, in phase t mod up, every up-th tap
    t = (np.arange(n_out) + skip) * down  # [n_out]
    taps = -(-h.size // up)
    hp = np.concatenate([h, np.zeros(taps * up - h.size)]).reshape(taps, up).T  # [up, taps]: hp[r, j] = h[r + j up]
    out = np.empty(n_out)
    xp = np.concatenate([x, np.zeros(taps + 1)])
    for start in range(0, n_out, 65536):  # [chunk, taps] gathers at a time
        tt = t[start:start + 65536]
        r, base = tt % up, tt // up  # h[r + j up] meets x[base - j]
        idx = base[:, None] - np.arange(taps)[None, :]  # [chunk, taps]
        ok = (idx >= 0) & (idx < n_in)
        out[start:start + tt.size] = np.sum(hp[r] * np.where(ok, xp[np.clip(idx, 0, n_in)], 0.0), axis=1)
    return out
