"""GPTQ and AWQ checkpoints (HF ``quantization_config``) -> decodert's block layout, exactly.

Both store a linear layer ``x @ W^T`` (W [N out, K in]) as int32 words of eight 4-bit values, bits
4j..4j+3 holding value j, with per-group fp16 ``scales`` [G, N] and packed zero points ``qzeros``
[G, N/8] (G = K / group_size):

    GPTQ  qweight [K/8, N]: word (i, n) holds W rows n, inputs 8i..8i+7 (packed along K)
          qzeros  [G, N/8]: word (g, i) holds outputs 8i..8i+7; the stored value is zero - 1
                  (``checkpoint_format`` "gptq"; "gptq_v2" stores the zero itself)
          g_idx   [K] int32: the group of each input (act-order, ``desc_act``: not k // group_size)
          W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
    AWQ   qweight [K, N/8]: packed along N, word (k, i) holds outputs 8i + AWQ_ORDER[j] in nibble j
          qzeros  [G, N/8]: the same order; the zero itself
          W[n, k] = scales[k // group, n] * (q[k, n] - zero[k // group, n])      ("version": "gemm")

Transcoded without re-rounding into ``QuantizedWeight`` (export/quantize/quant.py: q [N, K] two per
byte along K, scales [N, G] float32, zero points [N, G]): the fp16 scales widen exactly, the 4-bit
codes and zeros are copied. Zeros all 8 (GPTQ ``sym``) -> a symmetric weight (no zero points, what
TensorRT accepts). Act-order keeps q in input order with ``g_idx`` [K]: MatMulNBits takes it as
its g_idx input (ort, with float zero points: ORT 1.32's CPU kernel reads packed zero points wrongly
with g_idx), and the qdq layout reorders the inputs so each group is one block
(export/quantize/weight_layouts.py). Other layouts (3/8-bit, exllama/marlin/gemv packings, group
sizes other than 32/64/128) are refused in one line.

Nothing in the checkpoint is trusted: ``packed_format`` checks the settings' types (``bits: "4"`` is
not 4), ``packed_shape`` every packed tensor's stored dtype and shape against the format (qweight and
qzeros int32, scales fp16 / bf16 / fp32, g_idx int32; the shapes above), and ``unpack`` refuses
scales that are not finite (or overflow float32 once multiplied by a 4-bit difference), each in one
line naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from decodert.errors import DecodertError
from decodert.export.quantize.quant import QuantConfig, QuantizedWeight, WeightQuant, pack_nibbles

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble j of an AWQ word holds output 8i + AWQ_ORDER[j]
GROUP_SIZES = (32, 64, 128)
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
STORED_DTYPES = {"qweight": ("I32",), "qzeros": ("I32",), "scales": ("F16", "BF16", "F32"), "g_idx": ("I32",)}
MAX_DIFF = 15  # |q - zero| of a 4-bit code: a scale times it must stay a finite float32


@dataclass(frozen=True)
class PackedFormat:
    method: str  # "gptq" | "awq"
    group_size: int
    zero_offset: int  # added to the stored zeros (GPTQ v1 stores zero - 1)

    def quant_config(self) -> QuantConfig:
        """The export's settings when none are given: the checkpoint's own 4-bit blocks, lm_head float as it is."""
        return QuantConfig(bits=4, block_size=self.group_size, lm_head=False, scale_search=False)


def packed_format(config: dict, where: str) -> PackedFormat | None:
    """The checkpoint's ``quantization_config`` as a PackedFormat; None when it has none; a one-line
    DecodertError for a quantization decodert cannot transcode exactly."""
    qc = config.get("quantization_config")
    if qc is None or qc == {}:
        return None
    if not isinstance(qc, dict):
        raise DecodertError(f"{where}: quantization_config must be an object (quant_method, bits, group_size), "
                            f"got {_described(qc)}")
    method = qc.get("quant_method", "")
    if not isinstance(method, str) or method.lower() not in ("gptq", "awq"):
        raise DecodertError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                            "(decodert reads gptq and awq checkpoints)")
    method = method.lower()
    bits = _integer(qc, ("bits", "w_bit"), where)
    if bits != 4:
        raise DecodertError(f"{where}: {method} with {bits} bits is not supported (decodert transcodes 4-bit only)")
    group = _integer(qc, ("group_size", "q_group_size"), where)
    if group not in GROUP_SIZES:
        raise DecodertError(f"{where}: {method} group_size {group} is not supported (32, 64 or 128)")
    for key in ("version", "checkpoint_format"):
        if key in qc and not isinstance(qc[key], str):
            raise DecodertError(f"{where}: quantization_config.{key} must be a string, got {_described(qc[key])}")
    if "zero_point" in qc and not isinstance(qc["zero_point"], bool):
        raise DecodertError(f"{where}: quantization_config.zero_point must be true or false, "
                            f"got {_described(qc['zero_point'])}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is False:
            raise DecodertError(f"{where}: awq version {version!r} (zero_point={qc.get('zero_point', True)}) is "
                                "not supported: decodert reads the GEMM packing with zero points")
        return PackedFormat("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise DecodertError(f"{where}: gptq checkpoint_format {fmt!r} is not supported (an exllama/marlin-specific "
                            "layout); decodert reads the gptq and gptq_v2 packings")
    return PackedFormat("gptq", group, 1 if fmt == "gptq" else 0)


def _described(value: Any) -> str:
    """A JSON value for a one-line error: ``the string '4'``, ``the number 4.0``, ``true``, ``a list``."""
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    return "an object" if isinstance(value, dict) else "a list" if isinstance(value, list) else type(value).__name__


def _integer(qc: dict, keys: tuple[str, str], where: str) -> Any:
    """``qc[keys[0]]`` (else ``qc[keys[1]]``, AutoAWQ's name): an integer (not a bool, not "4", not 4.0)."""
    key = keys[1] if keys[1] in qc and keys[0] not in qc else keys[0]
    value = qc.get(key)
    if type(value) is not int:
        raise DecodertError(f"{where}: quantization_config.{key} must be an integer, got {_described(value)}")
    return value


def packed_shape(fmt: PackedFormat, stored: dict[str, tuple[str, tuple[int, ...]]],
                 where: Callable[[str], str]) -> tuple[int, int]:
    """[N, K] of one packed linear, from its tensors' stored (dtype, shape) by suffix, after checking each
    against the format; a one-line DecodertError names the tensor (``where(suffix)``), what it must be
    and what it is. Reads no data."""
    for suffix in ("qweight", "qzeros", "scales"):
        if suffix not in stored:
            raise DecodertError(f"{where('qweight')} has no {suffix} beside it ({fmt.method} stores "
                                "qweight, qzeros and scales per layer)")
    if fmt.method == "awq" and "g_idx" in stored:
        raise DecodertError(f"{where('g_idx')}: awq checkpoints have no g_idx (is the config's quant_method right?)")
    for suffix, (dtype, shape) in stored.items():
        if dtype not in STORED_DTYPES[suffix] or len(shape) != (1 if suffix == "g_idx" else 2):
            rank = "1-D" if suffix == "g_idx" else "2-D"
            raise DecodertError(f"{where(suffix)}: {fmt.method} {suffix} must be {rank} {' / '.join(STORED_DTYPES[suffix])}, "
                                f"found {dtype} {list(shape)}")
    k, n = stored["qweight"][1][0] * (8 if fmt.method == "gptq" else 1), stored["scales"][1][1]
    if n % 8:
        raise DecodertError(f"{where('scales')}: {fmt.method} scales {list(stored['scales'][1])} name {n} outputs, "
                            "not a multiple of the 8 an int32 word packs")
    groups = -(-k // fmt.group_size)
    expected = {"qweight": (k // 8, n) if fmt.method == "gptq" else (k, n // 8), "qzeros": (groups, n // 8),
                "scales": (groups, n), "g_idx": (k,)}
    for suffix, (dtype, shape) in stored.items():
        if shape != expected[suffix]:
            raise DecodertError(f"{where(suffix)}: {fmt.method} {suffix} of a [{n} out, {k} in] weight "
                                f"(group_size {fmt.group_size}) must be {dtype} {list(expected[suffix])}, "
                                f"found {dtype} {list(shape)}")
    return n, k


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., m] -> their eight 4-bit values [..., m, 8], value j from bits 4j..4j+3."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return ((u[..., None] >> (4 * np.arange(8))) & 0xF).astype(np.uint8)


def unpack(fmt: PackedFormat, t: dict[str, np.ndarray],
           where: Callable[[str], str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One packed linear's tensors (checked by ``packed_shape``; bf16 scales read as float32) -> (q [N, K] uint8,
    zeros [N, G] int, scales [N, G] float32, g_idx [K]); ``where(suffix)`` names a tensor in an error."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    with np.errstate(over="ignore", invalid="ignore"):
        bad = int((~np.isfinite(scales.astype(np.float32) * np.float32(MAX_DIFF))).sum())
    if bad:
        raise DecodertError(f"{where('scales')}: holds {bad} NaN, infinite or too large scales (a scale times "
                            f"{MAX_DIFF} must be a finite float32): a damaged file")
    g, n = scales.shape
    if fmt.method == "gptq":
        k = qweight.shape[0] * 8
        q = _nibbles(qweight).transpose(0, 2, 1).reshape(k, n).T  # [K/8, N, 8] -> [K, N] -> [N, K]
        zeros = _nibbles(qzeros).reshape(g, n).T.astype(np.int64) + fmt.zero_offset
        g_idx = t["g_idx"].astype(np.int64) if "g_idx" in t else np.arange(k) // fmt.group_size
    else:
        k = qweight.shape[0]
        inverse = np.argsort(AWQ_ORDER)  # output 8i + c sits in nibble inverse[c]
        q = _nibbles(qweight)[..., inverse].reshape(k, n).T
        zeros = _nibbles(qzeros)[..., inverse].reshape(g, n).T.astype(np.int64)
        g_idx = np.arange(k) // fmt.group_size
    if g != -(-k // fmt.group_size) or g_idx.shape != (k,):
        raise DecodertError(f"{where('qweight')}: {fmt.method} tensors disagree: qweight {list(qweight.shape)}, "
                            f"scales {list(scales.shape)}, group_size {fmt.group_size}")
    if k and (g_idx.min() < 0 or g_idx.max() >= g):
        raise DecodertError(f"{where('g_idx')}: names group {int(g_idx.min() if g_idx.min() < 0 else g_idx.max())}, "
                            f"but the layer has groups 0..{g - 1}")
    if zeros.size and zeros.max() > 15:
        raise DecodertError(f"{where('qzeros')}: a {fmt.method} zero point of {int(zeros.max())} does not fit 4 bits")
    return np.ascontiguousarray(q), zeros, scales.astype(np.float32).T.copy(), g_idx


def dequantize(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """The float32 [N, K] weight the checkpoint stores (the reference the transcoded weight matches)."""
    return (q.astype(np.float32) - zeros[:, g_idx].astype(np.float32)) * scales[:, g_idx]


def transcode(fmt: PackedFormat, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
              where: str) -> tuple[QuantizedWeight, WeightQuant]:
    """Fused parts (rows: q|k|v, gate|up) of one canonical weight -> QuantizedWeight + how it is stored."""
    g_idx = parts[0][3]
    if any(not np.array_equal(p[3], g_idx) for p in parts[1:]):
        raise DecodertError(f"{where}: the fused parts have different act-order g_idx; decodert fuses q/k/v and "
                            "gate/up into one matmul and cannot keep them exactly")
    q = np.concatenate([p[0] for p in parts])
    zeros = np.concatenate([p[1] for p in parts])
    scales = np.concatenate([p[2] for p in parts])
    n, k = q.shape
    blocks = scales.shape[1]
    act_order = not np.array_equal(g_idx, np.arange(k) // fmt.group_size)
    if act_order and (np.bincount(g_idx, minlength=blocks) != fmt.group_size).any():
        raise DecodertError(f"{where}: act-order g_idx groups are not {fmt.group_size} inputs each")
    symmetric = bool((zeros == 8).all())
    kp = blocks * fmt.group_size
    qp = np.zeros((n, kp), np.uint8)
    qp[:, :k] = q
    zp = np.pad(zeros.astype(np.uint8), ((0, 0), (0, blocks % 2)))
    wq = WeightQuant(4, fmt.group_size, symmetric, fmt.method, act_order=act_order)
    return QuantizedWeight(pack_nibbles(qp), scales, pack_nibbles(zp), n, k, blocks,
                           g_idx=g_idx.astype(np.int32) if act_order else None), wq
