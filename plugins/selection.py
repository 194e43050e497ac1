"""``--plugins auto|always|never``: which decodert ops the trt target emits as plugin nodes.

| TensorRT                                  | native layers                            | auto picks |
|-------------------------------------------|------------------------------------------|------------|
| >= 10.15, TensorRT-RTX 1.7                | KVCacheUpdate, RotaryEmbedding, Attention | native     |
| 10.13 (JetPack 7.1), 10.3 (JetPack 6)     | none of those (and no opset 23/24 parser)  | plugins    |

The answer is recorded in the manifest as ``"plugins": {"mode", "ops", "tensorrt", "reason"}``.
"""

from __future__ import annotations

from typing import Any

from decodert.errors import DecodertError
from decodert.plugins.trt.compat import load_trt, parse_version

MODES = ("auto", "always", "never")
PLUGIN_OPS = ("CachedAttention", "RMSNorm")
NATIVE_SINCE = (10, 15)  # first datacenter TensorRT with KVCacheUpdate + RotaryEmbedding (+ IAttention 10.14)


def _installed() -> tuple[str, bool] | None:
    """(description, has the native layers) of the installed TensorRT builder, or None."""
    try:
        _, info = load_trt(need_builder=True)
    except DecodertError:
        return None
    native = info.has_kv_cache_update_layer and info.has_rotary_layer and info.has_attention_layer
    return f"{info.describe()} (installed)", native


def _named(trt_version: str) -> tuple[str, bool]:
    version = parse_version(trt_version)
    if len(version) < 2:
        raise DecodertError(f"--trt-version '{trt_version}' is not a TensorRT version like 10.3 or 10.13.3")
    return f"tensorrt {trt_version} (--trt-version)", version >= NATIVE_SINCE


def choose_plugins(mode: str, target: Any, trt_version: str | None = None) -> dict[str, Any] | None:
    """The manifest record for ``--plugins mode`` (None for a target without plugin nodes).

    ``target``: an export/lowering/targets.py Target (its ``name`` and ``plugin_nodes``; this floor sits below export)."""
    if mode not in MODES:
        raise DecodertError(f"unknown --plugins '{mode}'; choose one of: {', '.join(MODES)}")
    if not target.plugin_nodes:
        if mode == "always" or trt_version:
            raise DecodertError(f"--plugins always / --trt-version apply to --target trt (got --target {target.name})")
        return None
    found = _named(trt_version) if trt_version else _installed()
    tensorrt = found[0] if found else None
    if mode != "auto":
        ops = list(PLUGIN_OPS) if mode == "always" else []
        return {"mode": mode, "ops": ops, "tensorrt": tensorrt, "reason": f"--plugins {mode}"}
    if found is None:
        return {"mode": mode, "ops": [], "tensorrt": None,
                "reason": "no TensorRT found at export time: assuming >= 10.15 native layers (pass --trt-version)"}
    native = found[1]
    reason = (f"{tensorrt} has KVCacheUpdate/RotaryEmbedding/Attention layers" if native
              else f"{tensorrt} lacks KVCacheUpdate/RotaryEmbedding/Attention layers (added in 10.15)")
    return {"mode": mode, "ops": [] if native else list(PLUGIN_OPS), "tensorrt": tensorrt, "reason": reason}
