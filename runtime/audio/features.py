"""Log-mel features in numpy, as the checkpoint's own feature extractor computes them (Whisper-style: a
centred STFT with reflect padding, a periodic Hann window, the power spectrum without its last frame, Slaney
mel filters, log10 floored at 1e-10 and at 8 below the clip's maximum, then (x + 4) / 4).

    settings = MelSettings.from_dict(manifest.audio.features)   # resolved at export (export/audio_export.py)
    mel, frames = log_mel(samples, settings)                     # [n_mels, T] float32, T valid frames

The rules, for one clip of n float32 samples at the model's rate (Qwen3ASRFeatureExtractor as
Qwen3ASRProcessor calls it, padding to the longest of a batch of one, no truncation):
- a clip shorter than ``min_samples`` is zero-padded to it (the valid frames count the padding too);
- ``pad_to`` (the extractor's ``padding="max_length"``): zeros appended up to that many samples, the valid
  frames still those of the clip (the attention mask);
- frames: 1 + L // hop from the centred STFT of the L samples, less the last: L // hop; valid: those that start
  inside the clip (its sample mask read every hop samples), n // hop for an unpadded clip;
- the time axis is right-padded with zeros to a multiple of ``frame_multiple`` (Qwen3-ASR: 2 * n_window,
  the encoder's chunk), those frames not valid.
Whisper's extractor is the same transform with padding to 30 s (``pad_to``) and no frame multiple: its family
(models/families/whisper.py ``window_features``) declares those settings, runtime/audio/whisper.py cuts the windows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class MelSettings:
    """A checkpoint's log-mel settings (its preprocessor_config.json over the family's defaults)."""

    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 128
    f_min: float = 0.0
    f_max: float = 8000.0
    min_samples: int = 0  # shorter clips are zero-padded to this many samples (Qwen3-ASR: 8000)
    frame_multiple: int = 0  # the frame axis padded to a multiple of this (Qwen3-ASR: 2 * n_window); 0: none
    pad_to: int = 0  # clips zero-padded to this many samples (Qwen2-Audio: 30 s, padding="max_length"); 0: none

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MelSettings":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 per 200 Hz), logarithmic above."""
    f = np.asarray(f, np.float64)
    mel = 3.0 * f / 200.0
    log = f >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(f, 1e-30) / 1000.0) * (27.0 / np.log(6.4)), mel)


def mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, np.float64)
    hz = 200.0 * m / 3.0
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), hz)


def mel_filters(s: MelSettings) -> np.ndarray:
    """[n_fft/2 + 1, n_mels] float32 triangular filters over linearly spaced FFT bins, centres evenly spaced in
    Slaney mels from f_min to f_max, each scaled to unit area (Slaney norm: 2 / bandwidth)."""
    bins = s.n_fft // 2 + 1
    centres = mel_to_hz(np.linspace(hz_to_mel(s.f_min), hz_to_mel(s.f_max), s.n_mels + 2))  # [n_mels + 2] Hz
    tri = triangles(np.linspace(0, s.sampling_rate // 2, bins), centres)
    return (tri * (2.0 / (centres[2:] - centres[:-2]))[None, :]).astype(np.float32)


def triangles(fft: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """[bins, n - 2] float64 triangular filters over the FFT bins' frequencies ``fft`` [bins] (Hz), filter k rising
    from ``centres[k]`` to 1 at ``centres[k + 1]`` and falling to 0 at ``centres[k + 2]`` (Hz), unscaled."""
    slopes = centres[None, :] - fft[:, None]  # [bins, n]
    width = np.diff(centres)
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    return np.maximum(0.0, np.minimum(down, up))


_FILTERS: dict[MelSettings, np.ndarray] = {}


def _filters(s: MelSettings) -> np.ndarray:
    f = _FILTERS.get(s)
    if f is None:
        f = _FILTERS[s] = mel_filters(s)
    return f


def power_spectrum(x: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """|STFT|^2 [n_fft/2 + 1, n // hop] of float32 samples [n]: torch.stft(center=True, reflect padding, periodic
    Hann), the last frame dropped."""
    pad = n_fft // 2
    if x.size <= pad:
        raise ValueError(f"a clip of {x.size} samples is too short for the reflect padding of {pad}")
    padded = np.pad(x.astype(np.float64), pad, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    count = x.size // hop  # 1 + n // hop frames, less the last
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop][:count]  # [count, n_fft]
    spec = np.fft.rfft(frames * window, axis=-1)  # [count, bins]
    return (spec.real ** 2 + spec.imag ** 2).T


def log_mel(samples: np.ndarray, s: MelSettings, pad_to: int | None = None) -> tuple[np.ndarray, int]:
    """One clip [n] at ``s.sampling_rate`` -> (log-mel [n_mels, T] float32, valid frames); T is the valid frames
    (or ``pad_to // hop``; ``pad_to`` None: ``s.pad_to``) rounded up to ``s.frame_multiple``."""
    x = np.asarray(samples, np.float32).reshape(-1)
    pad_to = pad_to if pad_to is not None else (s.pad_to or None)
    if x.size < s.min_samples:
        x = np.pad(x, (0, s.min_samples - x.size))
    n = x.size
    if pad_to is not None and pad_to > n:
        x = np.pad(x, (0, pad_to - n))
    # the extractor's sample mask [L] read every hop samples, less its last entry when hop does not divide L
    valid = min(-(-n // s.hop_length), x.size // s.hop_length)
    mel = _filters(s).T.astype(np.float64) @ power_spectrum(x, s.n_fft, s.hop_length)  # [n_mels, frames]
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    out = ((log + 4.0) / 4.0).astype(np.float32)
    if s.frame_multiple > 1 and out.shape[1] % s.frame_multiple:
        out = np.pad(out, ((0, 0), (0, s.frame_multiple - out.shape[1] % s.frame_multiple)))
    return out, valid
