"""Gemma 4's log-mel features in numpy, as Gemma4AudioFeatureExtractor computes them (the USM front end; not the
Whisper transform of features.py): magnitude, not power; HTK mel filters without area norm; natural log over a
floor; frames that start half a frame early; no maximum-relative floor.

    settings = Gemma4MelSettings.from_dict(manifest.audio.features)   # resolved at export (models/families/gemma4.py)
    mel, frames = log_mel(samples, settings)                           # [T, n_mels] float32, T >= frames valid

The rules, for one clip of n float32 samples at the model's rate (the extractor as Gemma4Processor calls it: a batch
of one, ``padding="longest"``, ``pad_to_multiple_of=128``, ``max_length=480000``, ``truncation=True``):
- a clip longer than ``max_samples`` is cut to it (rounded up to ``sample_multiple``: the extractor's truncation);
  then zeros are appended up to a multiple of ``sample_multiple`` samples (L samples);
- the samples x ``input_scale``, ``frame_length // 2`` zeros prepended (semicausal), frames of frame_length + 1
  samples every hop: (L + frame_length // 2 - frame_length - 1) // hop + 1 of them;
- pre-emphasis over each frame (HTK: the first sample x (1 - p), then s[i] - p s[i - 1]), or none (p = 0: the
  first frame_length samples), times a periodic Hann window of frame_length, |rfft| over ``fft_length`` points;
- mel = |X| @ filters (HTK mels from f_min to f_max, triangles over fft_length / 2 + 1 bins, unscaled);
  log(mel + mel_floor); less per_bin_mean, over per_bin_stddev (when the config has them);
- a frame is valid when the last sample of its window is one of the clip's (the extractor's frame-aware mask);
  invalid frames are zeros.
The STFT is float32, as the extractor's (numpy's rfft keeps float32), the filters and the log float64: in float64
throughout, quiet bins near the floor move by up to ~1e-3 (docs/features/audio.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from decodert.runtime.audio.features import triangles


@dataclass(frozen=True)
class Gemma4MelSettings:
    """Gemma4AudioFeatureExtractor's settings (its preprocessor_config.json over transformers' defaults)."""

    sampling_rate: int = 16000
    frame_length: int = 320  # samples (frame_length_ms)
    hop_length: int = 160  # samples (hop_length_ms)
    fft_length: int = 512  # the next power of two of frame_length (x 2 with fft_overdrive)
    n_mels: int = 128
    f_min: float = 0.0
    f_max: float = 8000.0
    mel_floor: float = 1e-3
    preemphasis: float = 0.0
    preemphasis_htk: bool = True
    input_scale: float = 1.0
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_samples: int = 480_000  # Gemma4Processor's max_length (30 s), with truncation
    sample_multiple: int = 128  # its pad_to_multiple_of

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Gemma4MelSettings":
        values = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        for k in ("per_bin_mean", "per_bin_stddev"):
            if values.get(k) is not None:
                values[k] = tuple(float(v) for v in values[k])
        return cls(**values)

    def frames(self, samples: int) -> tuple[int, int]:
        """(frames, valid frames) of a clip of ``samples`` samples (before truncation)."""
        n = min(samples, self.cut_length)
        padded = -(-n // self.sample_multiple) * self.sample_multiple
        count = max(0, (padded + self.frame_length // 2 - self.frame_length - 1) // self.hop_length + 1)
        # frame i's last sample, in the clip's indices: i hop + frame_length - frame_length // 2
        last = np.arange(count) * self.hop_length + self.frame_length - self.frame_length // 2
        return count, int((last < n).sum())

    @property
    def cut_length(self) -> int:
        m = self.sample_multiple
        return self.max_samples if self.max_samples % m == 0 else (self.max_samples // m + 1) * m


def htk_mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(f, np.float64) / 700.0)


def htk_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (np.power(10.0, np.asarray(m, np.float64) / 2595.0) - 1.0)


_FILTERS: dict[Gemma4MelSettings, np.ndarray] = {}


def mel_filters(s: Gemma4MelSettings) -> np.ndarray:
    """[fft_length / 2 + 1, n_mels] float64 triangles, centres evenly spaced in HTK mels from f_min to f_max."""
    f = _FILTERS.get(s)
    if f is None:
        centres = htk_hz(np.linspace(htk_mel(s.f_min), htk_mel(s.f_max), s.n_mels + 2))
        f = _FILTERS[s] = triangles(np.linspace(0, s.sampling_rate // 2, s.fft_length // 2 + 1), centres)
    return f


def log_mel(samples: np.ndarray, s: Gemma4MelSettings) -> tuple[np.ndarray, int]:
    """One clip [n] at ``s.sampling_rate`` -> (log-mel [T, n_mels] float32, its valid frames first, the rest zeros;
    the number of valid frames)."""
    x = np.asarray(samples, np.float32).reshape(-1)[: s.cut_length]
    count, valid = s.frames(x.size)
    if count == 0:
        return np.zeros((0, s.n_mels), np.float32), 0
    padded = np.zeros((count - 1) * s.hop_length + s.frame_length + 1, np.float32)
    clip = x * np.float32(s.input_scale) if s.input_scale != 1.0 else x
    pad = s.frame_length // 2
    padded[pad:pad + clip.size] = clip[: max(0, padded.size - pad)]
    frames = np.lib.stride_tricks.sliding_window_view(padded, s.frame_length + 1)[::s.hop_length][:count]
    p = np.float32(s.preemphasis)
    if p > 0.0 and s.preemphasis_htk:
        frames = np.concatenate([frames[:, :1] * (np.float32(1.0) - p), frames[:, 1:-1] - p * frames[:, :-2]], axis=-1)
    elif p > 0.0:
        frames = frames[:, 1:] - p * frames[:, :-1]
    else:
        frames = frames[:, :-1]
    # a periodic Hann window in float32, as the extractor stores it
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(s.frame_length) / s.frame_length)).astype(np.float32)
    magnitude = np.abs(np.fft.rfft(frames * window, n=s.fft_length, axis=-1))  # [T, bins] float32
    log = np.log(magnitude @ mel_filters(s) + s.mel_floor)  # [T, n_mels]
    if s.per_bin_mean is not None:
        log = log - np.asarray(s.per_bin_mean, np.float64)
    if s.per_bin_stddev is not None:
        log = log / np.asarray(s.per_bin_stddev, np.float64)
    out = log.astype(np.float32)
    out[valid:] = 0.0
    return out, valid
