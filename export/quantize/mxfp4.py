"""MXFP4 (OCP microscaling FP4), as gpt-oss stores its experts in Hugging Face checkpoints.

    X_blocks  uint8 [..., G, 16]   32 E2M1 values per block, two per byte, the even element in the low nibble
    X_scales  uint8 [..., G]       one E8M0 exponent per block: the block's values times 2 ** (s - 127)

Every E2M1 value times a power of two is exactly a float32, so decodert dequantizes MXFP4 exactly
(no rounding) and the export proceeds from float as for any checkpoint: float artifacts keep the
values exactly (fp16/bf16 round as for every float weight); ``--quant int4`` rounds them onto its
own int4 blocks (QMoE / block DequantizeLinear), not a transcode.
"""

from __future__ import annotations

import numpy as np

from decodert.errors import DecodertError

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32], exactly."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    with np.errstate(over="ignore"):  # a huge exponent gives inf, which the checkpoint then refuses (check_finite)
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def mxfp4_shape(blocks: tuple[str, tuple[int, ...]], scales: tuple[str, tuple[int, ...]], where: str) -> tuple[int, int, int]:
    """[E, N, G] of stacked MXFP4 experts from their tensors' stored (dtype, shape): blocks U8 [E, N, G, 16]
    and scales U8 [E, N, G], else a one-line DecodertError naming what ``where`` holds and what it should."""
    (bd, bs), (sd, ss) = blocks, scales
    if bd != "U8" or sd != "U8" or len(bs) != 4 or bs[-1] != 16 or tuple(ss) != tuple(bs[:3]):
        raise DecodertError(f"{where}: MXFP4 experts must be _blocks U8 [E, N, G, 16] and _scales U8 [E, N, G]; "
                            f"found _blocks {bd} {list(bs)} and _scales {sd} {list(ss)}")
    return bs[0], bs[1], bs[2]
