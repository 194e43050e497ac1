"""Checks that a structurally valid checkpoint also makes sense, before anything is exported.

The header walks (export/checkpoints/gguf_header.py, artifact/safetensors_file.py) prove a file can be
read; these prove what it says is consistent, as llama.cpp refuses such files too:

- ``check_spec``: float settings finite and positive where they must be (RoPE base, RMS epsilon...);
- ``check_tensors_used``: every tensor the file holds is a weight the model reads (a ``block_count``
  smaller than the blocks present would silently cut the model); a family may name tensors it
  knows and ignores in ``GGUF_UNUSED`` / ``HF_UNUSED``;
- ``check_finite``: no NaN or infinity in a weight after dequantization (a damaged offset or scale).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from decodert.errors import DecodertError

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:blk|layers|h)\.(\d+)\.")
_SHOWN = 4


def check_spec(spec: Any, where: Path | str) -> None:
    """Finite, positive float settings: ``rms_norm_eps``, RoPE ``theta``, scaling factors."""
    rope = spec.rope
    positive = {"rms_norm_eps": spec.rms_norm_eps, "rope theta (freq_base)": rope.theta, "rope scaling factor": rope.factor}
    if rope.scaling == "llama3":
        positive.update({"rope low_freq_factor": rope.low_freq_factor, "rope high_freq_factor": rope.high_freq_factor})
    for name, value in positive.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise DecodertError(f"{where}: {name} is {value!r}; it must be a finite number > 0")
    if spec.rms_norm_eps >= 1:
        raise DecodertError(f"{where}: rms_norm_eps {spec.rms_norm_eps!r} must be below 1 (typically 1e-5 or 1e-6)")
    if rope.scaling == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise DecodertError(f"{where}: rope high_freq_factor {rope.high_freq_factor} must exceed "
                            f"low_freq_factor {rope.low_freq_factor}")


def check_tensors_used(present: Iterable[str], used: set[str], num_layers: int, where: Path | str,
                       ignored: Iterable[str] = (), strict: bool = True) -> None:
    """Every tensor in the file is used or known to be ignored (``ignored``: regexes); blocks past
    ``num_layers`` are named. ``strict=False`` (HF folders, which often carry extras such as a tied
    ``lm_head.weight``) refuses only the tensors of layers past ``num_layers``."""
    ignored_patterns = [re.compile(p) for p in ignored]
    stray = sorted(k for k in present if k not in used and not any(p.fullmatch(k) for p in ignored_patterns))
    if not stray:
        return
    beyond = sorted({int(m.group(1)) for k in stray if (m := _LAYER_INDEX.search(k)) and int(m.group(1)) >= num_layers})
    if beyond:
        raise DecodertError(f"{where}: declares {num_layers} layers (block_count / num_hidden_layers) but holds "
                            f"tensors of layer {beyond[-1]} ({_names(stray)}); the file is inconsistent")
    if not strict:
        return
    raise DecodertError(f"{where}: holds {len(stray)} tensors the model does not use ({_names(stray)}); "
                        "refusing rather than ignoring them")


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def check_finite(arrays: Iterable[np.ndarray | None], key: str, where: Path | str) -> None:
    """Refuse NaN / infinity in a tensor (or the scales of its blocks) after dequantization."""
    for a in arrays:
        if a is not None and a.dtype.kind == "f" and not np.isfinite(a).all():
            bad = int(a.size - np.isfinite(a).sum())
            raise DecodertError(f"{where}: tensor '{key}' holds {bad} NaN or infinite values after dequantization "
                                "(a damaged file)")


def tokenizer_vocab(path: Path, model_vocab: int, where: Path | str) -> int:
    """The number of ids ``path`` (tokenizer.json) knows, added tokens included; refused when it is
    larger than the model's embedding (ids the graph cannot embed). Smaller is normal: many models
    pad their embedding (Qwen2.5: 151,665 tokens, 151,936 rows)."""
    from tokenizers import Tokenizer

    try:
        n = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise DecodertError(f"{where}: cannot load the tokenizer ({str(e).splitlines()[0] if str(e) else e!r})") from None
    if n > model_vocab:
        raise DecodertError(f"{where}: the tokenizer has {n} tokens but the model embeds only {model_vocab}; "
                            "tokenizer and weights do not belong together")
    return n
