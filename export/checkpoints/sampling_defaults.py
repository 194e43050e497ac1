"""The model's recommended sampling settings, found at export and recorded in the manifest.

    manifest["sampling"] = {"defaults": {"temperature": 0.2, "top_p": 0.5}, "source": "..."}

The manifest checks the record (artifact/manifest.py ``sampling_problem``). The runtime fills every
generation parameter a caller does not pass from ``defaults`` (explicit arguments always win, one
parameter at a time). Where they come from, first match:

1. an HF folder's ``generation_config.json`` that sets do_sample or a sampling parameter: with
   ``do_sample: true`` its temperature, top_k, top_p, min_p and repetition_penalty, the unset
   ones at transformers' own defaults (temperature 1.0, top_k 50, top_p 1.0); otherwise greedy
   (plus its repetition_penalty), as transformers' ``generate`` does;
2. a GGUF's ``general.sampling.*`` keys (llama.cpp's recommended settings): the ones present,
   the others at llama.cpp's defaults (temp 0.8, top_k 40, top_p 0.95, min_p 0.05);
3. ``MODEL_CARDS``: settings published on a model's card, for models whose files carry none;
4. nothing: greedy decoding.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from decodert.artifact.manifest import KNOBS

_INT_KNOBS = ("top_k",)

HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' GenerationConfig
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp common_params
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}

# (pattern over the model's names, needs a chat template, settings, where they are published)
MODEL_CARDS: tuple[tuple[re.Pattern, bool, dict[str, float], str], ...] = (
    # The card says top_p 0.9; with it SmolLM2-135M answered "What is the capital of France?" in French
    # or in a loop in 5 of 20 seeds (fp32, as transformers does), with top_p 0.5 in 0 of 20 (measured
    # 2026-12-03, docs/benchmarks/history.md "First run"): the card's temperature, a tighter nucleus.
    (re.compile(r"smollm2", re.I), True, {"temperature": 0.2, "top_p": 0.5},
     "the SmolLM2-Instruct model card's temperature (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), "
     "with top_p 0.5 instead of its 0.9 (wrong answers in 5 of 20 seeds with 0.9, measured)"),
)


def sampling_record(ckpt: Any, chat_template: str | None) -> dict[str, Any]:
    """manifest["sampling"] for a checkpoint (HF folder or GGUF), following the order above."""
    if ckpt.kind == "hf":
        found = _from_generation_config(Path(ckpt.source) / "generation_config.json")
    else:
        found = _from_gguf(getattr(ckpt, "meta", {}))
    if found is None:
        found = _from_model_card(_model_names(ckpt), chat_template)
    return found or {"defaults": {"temperature": 0.0}, "source": "none: greedy decoding"}


def _from_generation_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None  # a broken optional file: the export does not depend on it
    if not isinstance(config, dict) or not any(k in config for k in ("do_sample", *KNOBS)):
        return None  # declares no sampling at all (e.g. written from config.json by save_pretrained)
    if config.get("do_sample") is True:
        defaults = {**HF_SAMPLING_DEFAULTS, **_pick(config, {k: k for k in KNOBS})}
    else:
        defaults = {"temperature": 0.0, **_pick(config, {"repetition_penalty": "repetition_penalty"})}
    return {"defaults": defaults, "source": f"{path.name} (do_sample {bool(config.get('do_sample'))})"}


def _from_gguf(meta: dict[str, Any]) -> dict[str, Any] | None:
    given = _pick(meta, _GGUF_KEYS)
    if not given:
        return None
    return {"defaults": {**LLAMA_CPP_DEFAULTS, **given}, "source": "GGUF general.sampling.* (llama.cpp settings)"}


def _model_names(ckpt: Any) -> str:
    """The names a checkpoint goes by: GGUF general.* names, an HF config's _name_or_path, the file name."""
    meta = getattr(ckpt, "meta", {}) or {}
    config = getattr(ckpt, "config", {}) or {}
    parts = [meta.get(k) for k in ("general.basename", "general.name")] + [config.get("_name_or_path")]
    return " ".join(str(p) for p in parts + [Path(ckpt.source).name] if isinstance(p, str))


def _from_model_card(names: str, chat_template: str | None) -> dict[str, Any] | None:
    for pattern, needs_chat, defaults, where in MODEL_CARDS:
        if pattern.search(names) and (chat_template or not needs_chat):
            return {"defaults": dict(defaults), "source": where}
    return None


def _pick(values: dict[str, Any], names: dict[str, str]) -> dict[str, float | int]:
    """{knob: value} for the keys of ``names`` present in ``values`` as finite numbers (others ignored)."""
    out: dict[str, float | int] = {}
    for key, knob in names.items():
        v = values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[knob] = int(v) if knob in _INT_KNOBS else float(v)
    return out


def describe(record: Any) -> str:
    """One line for ``decodert inspect``: the settings (a manifest SamplingRecord) and where they come from."""
    if record is None:
        return "greedy (the artifact records no defaults)"
    d = record.defaults
    if d.get("temperature", 0.0) == 0:
        text = "greedy" + "".join(f", {k} {v:g}" for k, v in d.items() if k != "temperature")
    else:
        text = ", ".join(f"{k} {v:g}" for k, v in d.items())
    return f"{text}  (from {record.source}; explicit arguments override)"

