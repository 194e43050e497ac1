"""Read a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) into a LoraAdapter.

What PEFT writes and what is read from it:
- tensors ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and ``...lora_B.weight``
  [out, r], one pair per adapted module; the module names map to canonical parts by ``lora_layout.PEFT_MODULES``;
- ``r`` / ``lora_alpha`` (+ ``rank_pattern`` / ``alpha_pattern`` per module), ``use_rslora``: the scale folded
  into B is ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA; the rank of each module is its tensors' shape.
Anything decodert cannot apply exactly is a one-line DecodertError: DoRA, LoRA biases, ``modules_to_save``,
embedding or lm_head adapters, a module name outside the table, or shapes/layers the base model does not have.
So is a config PEFT itself could not load: ``r`` / ``rank_pattern`` values that are not positive integers (or
differ from the tensors' rank), ``lora_alpha`` / ``alpha_pattern`` values that are not positive finite numbers
(``"x"``, ``true``, 0, -8), pattern keys that are not regular expressions, and weights or a scaled B that are
not finite float32 (``lora_alpha: 1e300``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.safetensors_file import SafetensorsFile
from decodert.artifact.lora_layout import PEFT_MODULES, LoraAdapter, in_features, part_rows
from decodert.models.spec import ModelSpec

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*\.layers\.(?P<layer>\d+)\.(?:[\w.]+\.)?(?P<leaf>\w+))"
                  r"\.lora_(?P<ab>[AB])\.weight$")


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise DecodertError(f"LoRA adapter {folder}: cannot read {CONFIG} ({e.strerror or e}); a PEFT adapter folder "
                            f"holds {CONFIG} and {WEIGHTS}") from None
    except ValueError:
        raise DecodertError(f"LoRA adapter {folder}: {CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise DecodertError(f"LoRA adapter {folder}: {CONFIG} is not a JSON object")
    problems = [
        (str(config.get("peft_type", "LORA")).upper() != "LORA", f"peft_type {config.get('peft_type')!r} is not LORA"),
        (bool(config.get("use_dora")), "DoRA (use_dora) is not supported"),
        (config.get("bias", "none") != "none", f"LoRA biases (bias={config.get('bias')!r}) are not supported"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')} is not supported "
                                              "(only LoRA A/B pairs on the linear layers)"),
        (bool(config.get("lora_bias")), "lora_bias (a bias on lora_B) is not supported"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D models) is not supported"),
        (bool(config.get("layer_replication")), "layer_replication is not supported"),
    ]
    for bad, what in problems:
        if bad:
            raise DecodertError(f"LoRA adapter {folder}: {what}")
    _check_numbers(config, f"LoRA adapter {folder}: {CONFIG}")
    return config


def _rank_ok(v: Any) -> bool:
    return type(v) is int and v > 0


def _alpha_ok(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _check_numbers(config: dict, where: str) -> None:
    """``r``, ``lora_alpha``, ``use_rslora`` and the per-module patterns have the types PEFT gives them."""
    for key, ok, what in (("r", _rank_ok, "a positive integer"), ("lora_alpha", _alpha_ok, "a positive finite number")):
        if key in config and not ok(config[key]):
            raise DecodertError(f"{where}: {key} must be {what}, got {json.dumps(config[key])[:40]}")
    if "use_rslora" in config and not isinstance(config["use_rslora"], bool):
        raise DecodertError(f"{where}: use_rslora must be true or false, got {json.dumps(config['use_rslora'])[:40]}")
    for key, ok, what in (("rank_pattern", _rank_ok, "positive integers"),
                          ("alpha_pattern", _alpha_ok, "positive finite numbers")):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise DecodertError(f"{where}: {key} must map module names to {what}, got {json.dumps(patterns)[:40]}")
        for name, value in patterns.items():
            if not ok(value):
                raise DecodertError(f"{where}: {key}[{name!r}] must be one of {what}, got {json.dumps(value)[:40]}")
            try:
                re.compile(name)
            except re.error as e:
                raise DecodertError(f"{where}: {key} key {name!r} is not a regular expression ({e})") from None


def read_peft(folder: str | Path, spec: ModelSpec, name: str | None = None) -> LoraAdapter:
    """The adapter in ``folder`` for a model of ``spec`` (checked against it)."""
    folder = Path(folder)
    config = read_config(folder)
    if not (folder / WEIGHTS).is_file():
        raise DecodertError(f"LoRA adapter {folder}: no {WEIGHTS} (decodert reads safetensors adapters only)")
    base = config.get("base_model_name_or_path") or "?"
    where = f"LoRA adapter {folder} (base model {base})"
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    st = SafetensorsFile(folder / WEIGHTS)
    try:
        for key in st.keys():
            m = _KEY.match(key)
            if m is None:
                raise DecodertError(f"{where}: tensor '{key}' adapts a module decodert cannot map to its weights "
                                    f"(it maps {', '.join(PEFT_MODULES)})")
            if m["leaf"] not in PEFT_MODULES:
                raise DecodertError(f"{where}: module '{m['leaf']}' cannot be mapped to decodert's weights "
                                    f"(it maps {', '.join(PEFT_MODULES)})")
            pairs.setdefault((int(m["layer"]), m["module"]), {})[m["ab"]] = st.read(key)
    finally:
        st.close()
    if not pairs:
        raise DecodertError(f"{where}: {WEIGHTS} holds no LoRA weights")
    adapter = LoraAdapter(name or folder.name)
    for (layer, module), ab in sorted(pairs.items()):
        _add_module(adapter, spec, config, where, layer, module, ab)
    return adapter


def _add_module(adapter: LoraAdapter, spec: ModelSpec, config: dict, where: str, layer: int, module: str,
                ab: dict[str, np.ndarray]) -> None:
    """Check one module's A/B against the base model and store it per canonical part, scaled."""
    leaf = module.rsplit(".", 1)[-1]
    target, parts = PEFT_MODULES[leaf]
    if set(ab) != {"A", "B"}:
        raise DecodertError(f"{where}: {module} has lora_{'A' if 'A' in ab else 'B'} but not the other")
    a, b = ab["A"], ab["B"]
    rows = part_rows(spec, target)
    want_out = sum(rows[p] for p in parts)
    if layer >= spec.num_layers or a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features(spec, target) \
            or b.shape != (want_out, a.shape[0]):
        raise DecodertError(f"{where} does not fit this {spec.family} model: {module} lora_A {list(a.shape)} / "
                            f"lora_B {list(b.shape)}, the model has {spec.num_layers} layers and expects "
                            f"[r, {in_features(spec, target)}] / [{want_out}, r] there")
    r = a.shape[0]
    configured = _pattern(config.get("rank_pattern"), module, config.get("r", r))
    if configured != r:
        raise DecodertError(f"{where}: {module} lora_A {list(a.shape)} has rank {r}, but {CONFIG} says r {configured}")
    alpha = float(_pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    for ab_name, w in (("lora_A", a), ("lora_B", b)):
        if not np.isfinite(w).all():
            raise DecodertError(f"{where}: {module}.{ab_name} holds {int(w.size - np.isfinite(w).sum())} NaN or "
                                "infinite values (a damaged file)")
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = b * np.float32(scale) if scale <= np.finfo(np.float32).max else np.full_like(b, np.inf)
    if not np.isfinite(scaled).all():
        rule = "lora_alpha / sqrt(r)" if config.get("use_rslora") else "lora_alpha / r"
        raise DecodertError(f"{where}: {module}: lora_B times its scale {rule} = {scale:g} (lora_alpha {alpha:g}) "
                            "is not a finite float32")
    start = 0
    for part in parts:
        adapter.parts[(layer, part)] = (a, scaled[start : start + rows[part]])
        start += rows[part]


def _pattern(patterns: Any, module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
