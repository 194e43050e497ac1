"""Rotary position embeddings as decodert computes their tables (rotate-half / NeoX layout, as transformers).

``RopeSpec`` is re-exported by models/spec.py, where ``ModelSpec.rope`` / ``local_rope`` hold one each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding (rotate-half / NeoX layout, as in transformers)."""

    theta: float = 10000.0
    scaling: str | None = None  # None | "linear" | "llama3" | "yarn" | "proportional" | "none" (angle 0: an identity)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3
    rotary_dim: int | None = None  # None = the whole head
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it (0.1 ln(factor) + 1 by default)
    proportion: float = 1.0  # proportional (Gemma 4): the first proportion * head_dim / 2 angles turn, the rest are 0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """[rot_dim/2] float64 inverse frequencies after scaling."""
        dim = self.rotary_dim or head_dim
        if self.scaling == "none":  # a layer without RoPE: every angle 0, so rotating is x*1 + rot(x)*0 = x exactly
            return np.zeros(dim // 2)
        if self.scaling == "proportional":  # transformers' _compute_proportional_rope_parameters: the whole head
            # rotates (rotate-half over head_dim), frequencies theta^(-2j/head_dim) for the first angles, 0 after
            angles = int(self.proportion * dim // 2)
            inv = np.zeros(dim // 2)
            inv[:angles] = 1.0 / (self.theta ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / dim))
            return inv / self.factor
        inv = 1.0 / (self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.scaling == "linear":
            inv = inv / self.factor
        elif self.scaling == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        elif self.scaling == "yarn":
            inv = self._yarn(inv, dim)
        return inv

    def _yarn(self, inv: np.ndarray, dim: int) -> np.ndarray:
        """YaRN (transformers' _compute_yarn_parameters): interpolated frequencies (inv / factor) for the
        long wavelengths, the original ones for the short, a linear ramp between the correction dims."""
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
        extrapolation = 1 - ramp
        return inv / self.factor * (1 - extrapolation) + inv * extrapolation

    def cos_sin(self, head_dim: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin tables [max_pos, rot_dim/2] in float32 (computed in float64)."""
        angles = np.outer(np.arange(max_pos, dtype=np.float64), self.inv_freq(head_dim))
        a = self.attention_factor
        return (np.cos(angles) * a).astype(np.float32), (np.sin(angles) * a).astype(np.float32)
