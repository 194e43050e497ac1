"""Import whichever TensorRT is installed and say what it can do.

Flavours, tried in this order unless ``prefer`` (or ``$DECODERT_TRT``) names one:

| flavour          | import                                   | builds | notes                                   |
|------------------|------------------------------------------|--------|-----------------------------------------|
| `tensorrt`       | `tensorrt` (10.x, 11.x)                  | yes    | datacenter/Jetson; weakly typed < 11    |
| `tensorrt_rtx`   | `tensorrt_rtx_bindings`, `tensorrt_rtx`  | yes    | always strongly typed; JIT at runtime   |
| `tensorrt_lean`  | `tensorrt_lean`                          | no     | runtime only (version-compatible plans) |

Capabilities are read off the module with ``hasattr`` where the module has a builder (the layer
classes exist exactly when the builder can emit them); a runtime-only module has no layer
classes, so there they follow the TensorRT version (IAttention 10.14, KVCacheUpdate and
RotaryEmbedding 10.15; weakly typed networks removed in 11.0).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from decodert.errors import DecodertError

INSTALL_HINT = "pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings"

# flavour -> module names to try, in order
CANDIDATES: dict[str, tuple[str, ...]] = {
    "tensorrt": ("tensorrt",),
    "tensorrt_rtx": ("tensorrt_rtx_bindings", "tensorrt_rtx"),
    "tensorrt_lean": ("tensorrt_lean",),
}
# first datacenter TensorRT version with each native layer (used for runtime-only modules)
_MIN_TRT = {"attention": (10, 14), "kv_cache_update": (10, 15), "rotary": (10, 15)}


@dataclass(frozen=True)
class TrtInfo:
    flavour: str  # "tensorrt" | "tensorrt_rtx" | "tensorrt_lean"
    module_name: str  # what was imported
    version: tuple[int, ...]  # e.g. (1, 7, 1, 116) for TensorRT-RTX 1.7.1.116
    can_build: bool  # has Builder + OnnxParser
    has_kv_cache_update_layer: bool  # ONNX TensorScatter-24 -> KV_CACHE_UPDATE
    has_rotary_layer: bool  # ONNX RotaryEmbedding-23 -> ROTARY_EMBEDDING
    has_attention_layer: bool  # ONNX Attention-23 -> IAttention (ATTENTION_INPUT/OUTPUT)
    weakly_typed_allowed: bool  # BuilderFlag.FP16/BF16 on a weakly typed network (TRT < 11)
    has_timing_cache: bool  # a timing cache changes anything (no-op in TensorRT-RTX >= 1.2)
    has_runtime_cache: bool  # IRuntimeConfig runtime (JIT kernel) cache, TensorRT-RTX
    has_engine_validity: bool  # Runtime.get_engine_validity(buffer) without deserializing
    has_aliased_io: bool  # ICudaEngine.get_aliased_input_tensor (present == past buffer)
    has_version_compatible: bool  # BuilderFlag.VERSION_COMPATIBLE
    has_compute_capability: bool  # IBuilderConfig.set_compute_capability (RTX AOT targets)

    @property
    def version_str(self) -> str:
        return ".".join(str(v) for v in self.version)

    def describe(self) -> str:
        return f"{self.flavour} {self.version_str}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = self.version_str
        return d


def parse_version(text: str) -> tuple[int, ...]:
    """'10.15.1.29' -> (10, 15, 1, 29); non-numeric tails ('1.7.1.116.post1') are dropped."""
    parts = []
    for piece in text.split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def _probe(trt: ModuleType, flavour: str, module_name: str) -> TrtInfo:
    version = parse_version(getattr(trt, "__version__", "0"))
    can_build = hasattr(trt, "Builder") and hasattr(trt, "OnnxParser")
    flag = getattr(trt, "BuilderFlag", None)
    engine = getattr(trt, "ICudaEngine", None)
    config = getattr(trt, "IBuilderConfig", None)
    dc = flavour != "tensorrt_rtx"  # datacenter-numbered versions

    def layer(cls: str, key: str) -> bool:
        if can_build:
            return hasattr(trt, cls)
        return dc and version >= _MIN_TRT[key]

    return TrtInfo(
        flavour=flavour,
        module_name=module_name,
        version=version,
        can_build=can_build,
        has_kv_cache_update_layer=layer("IKVCacheUpdateLayer", "kv_cache_update"),
        has_rotary_layer=layer("IRotaryEmbeddingLayer", "rotary"),
        has_attention_layer=layer("IAttention", "attention"),
        weakly_typed_allowed=dc and version < (11,) and flag is not None and hasattr(flag, "FP16"),
        has_timing_cache=dc and config is not None and hasattr(config, "create_timing_cache"),
        has_runtime_cache=hasattr(trt, "IRuntimeConfig") and hasattr(trt, "IRuntimeCache"),
        has_engine_validity=hasattr(getattr(trt, "Runtime", None), "get_engine_validity"),
        has_aliased_io=engine is not None and hasattr(engine, "get_aliased_input_tensor"),
        has_version_compatible=flag is not None and hasattr(flag, "VERSION_COMPATIBLE"),
        has_compute_capability=config is not None and hasattr(config, "set_compute_capability"),
    )


def _order(prefer: str | None) -> list[str]:
    prefer = prefer or os.environ.get("DECODERT_TRT") or None
    if prefer is None:
        return list(CANDIDATES)
    if prefer not in CANDIDATES:
        raise DecodertError(f"unknown TensorRT flavour '{prefer}'; choose one of: {', '.join(CANDIDATES)}")
    return [prefer]


def load_trt(prefer: str | None = None, need_builder: bool = False) -> tuple[ModuleType, TrtInfo]:
    """Import the first TensorRT flavour that is installed; return (module, info).

    ``prefer`` (or ``$DECODERT_TRT``) restricts the search to one flavour; ``need_builder``
    skips runtime-only modules. Raises DecodertError naming the install command when none is found.
    """
    tried = []
    for flavour in _order(prefer):
        for name in CANDIDATES[flavour]:
            try:
                trt = importlib.import_module(name)
            except (ImportError, OSError) as e:  # OSError: wheel present but its libraries are not
                tried.append(f"{name} ({type(e).__name__})")
                continue
            if not hasattr(trt, "Runtime"):  # e.g. a stubs-only or namespace 'tensorrt' package
                tried.append(f"{name} (not a TensorRT module)")
                continue
            info = _probe(trt, flavour, name)
            if need_builder and not info.can_build:
                tried.append(f"{name} (runtime only)")
                continue
            return trt, info
    what = "a TensorRT builder" if need_builder else "TensorRT"
    raise DecodertError(f"{what} is not installed (tried {', '.join(tried)}): {INSTALL_HINT}")


def engine_version_problem(built: Mapping[str, Any], info: TrtInfo, version_compatible: bool = False) -> str | None:
    """Why the installed TensorRT (``info``) cannot load an engine recorded as ``built``
    ({"flavour", "version"}: manifest.engines[name].tensorrt); None when it can.

    Plans are tied to the TensorRT that built them: the same flavour and major.minor.patch, or,
    for engines built with --version-compatible, the same major and an equal or newer runtime
    (the lean runtime loads only such engines from datacenter TensorRT).
    """
    flavour, text = built.get("flavour"), str(built.get("version", ""))
    version = parse_version(text)
    have = f"{info.describe()} is installed"
    if info.flavour == "tensorrt_lean":
        if flavour != "tensorrt" or not version_compatible:
            return f"engine built with {flavour} {text} without --version-compatible; the lean runtime ({have}) cannot load it"
    elif flavour != info.flavour:
        return f"engine built with {flavour} {text} but {have}"
    if version_compatible:
        if version[:1] != info.version[:1] or info.version < version:
            return f"version-compatible engine built with {flavour} {text} needs the same major, equal or newer; {have}"
        return None
    if version[:3] != info.version[:3]:
        return f"engine built with {flavour} {text} but {have}; rebuild with `decodert build` or install {flavour} {text}"
    return None


def read_engine(artifact_dir: Path, manifest: Any, name: str, info: TrtInfo) -> bytes:
    """The engine's bytes after the checks that need no GPU: recorded TensorRT version, size, sha256.

    ``manifest``: an artifact/manifest.py Manifest (this floor sits below export, so it is not named here)."""
    rec = (manifest.engines or {}).get(name)
    if rec is None:
        raise DecodertError(f"{artifact_dir / 'manifest.json'} has no '{name}' engine; run `decodert build {artifact_dir}`")
    path = artifact_dir / rec.file
    problem = engine_version_problem(rec.tensorrt, info, rec.version_compatible)
    if problem:
        raise DecodertError(f"{path}: {problem}")
    if not path.is_file():
        raise DecodertError(f"{path}: missing; run `decodert build {artifact_dir}`")
    blob: bytes = path.read_bytes()
    if len(blob) != rec.size:
        raise DecodertError(f"{path}: {len(blob)} bytes but the manifest recorded {rec.size}: truncated or "
                            f"damaged; run `decodert build {artifact_dir}` again")
    if hashlib.sha256(blob).hexdigest() != rec.sha256:
        raise DecodertError(f"{path}: sha256 does not match the manifest: damaged or replaced; rebuild it")
    return blob
