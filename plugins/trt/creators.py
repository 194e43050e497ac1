"""Register the decodert ops with TensorRT so its ONNX parser accepts ``decodert::`` plugin nodes.

    register_plugins()          one IPluginCreatorV3One per op, under namespaces "" and "decodert"
                                (parsers look up "" or, from TensorRT 10.10, the node's domain)
    DecodertPlugin              IPluginV3 = OneCore + OneBuildV2 (in-place present_* outputs via
                                get_aliased_input) + OneRuntime (enqueue: Triton kernels on the
                                stream TensorRT passes; plugins/trt/enqueue.py)

The quick ``tensorrt.plugin`` API (@trtp.register / @trtp.aot_impl, TensorRT >= 10.6) would embed
the Triton kernels' PTX in the engine, but tensorrt_rtx_bindings 1.7 does not ship that module
(``import tensorrt_rtx_bindings.plugin`` fails), so this is the IPluginV3 path, which both flavours
have: engines then need this module registered (and Triton) in the process that runs them.

Shapes come from each op's shape rule (plugins/registry.py) over IDimensionExpr; dtypes from the
schema ("T" = the first input's float type). Nothing here needs a GPU until enqueue.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from decodert.errors import DecodertError
from decodert.plugins.catalog import get_op
from decodert.plugins.registry import DOMAIN, OpDef
from decodert.plugins.trt.plugin_base import attrs_from_fields, make_plugin_class, plugin_fields

TRT_OPS = ("CachedAttention", "RMSNorm")  # MatMulNBits: TensorRT >= 10.0 has int4 block DequantizeLinear natively
NAMESPACES = ("", DOMAIN)
VERSION = "1"
_KEEP: dict[tuple[int, str, str], Any] = {}  # creators must outlive the registry's raw pointers to them
_CLASSES: dict[int, type] = {}


# ---------------------------------------------------------------- TensorRT-RTX loader check
def rtx_alias_dir(cache: Path | None = None) -> Path:
    """A folder holding ``libtensorrt_rtx.so -> <wheel>/libtensorrt_rtx.so.1`` (made if missing)."""
    libs = Path(importlib.import_module("tensorrt_rtx_libs").__file__).parent
    folder = Path(cache or os.environ.get("DECODERT_CACHE", Path.home() / ".cache" / "decodert")) / "trt-rtx-alias"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "libtensorrt_rtx.so"
    if not link.exists():
        link.symlink_to(libs / "libtensorrt_rtx.so.1")
    return folder


def check_plugin_loader(info: Any) -> None:
    """TensorRT-RTX 1.7's ONNX parser dlopens "libtensorrt_rtx.so" when it imports a plugin node,
    and the wheel ships only libtensorrt_rtx.so.1: the parser then throws inside a noexcept path
    and the process aborts. Refuse early, with the fix, instead."""
    if info.flavour != "tensorrt_rtx":
        return
    try:
        libs = Path(importlib.import_module("tensorrt_rtx_libs").__file__).parent
    except ImportError:
        return  # a system install: the unversioned name is normally there
    if (libs / "libtensorrt_rtx.so").exists():
        return
    try:
        ctypes.CDLL("libtensorrt_rtx.so")  # LD_LIBRARY_PATH / ld.so.cache, as the parser would search
        return
    except OSError:
        pass
    folder = rtx_alias_dir()
    raise DecodertError(f"TensorRT-RTX's ONNX parser needs 'libtensorrt_rtx.so' to import plugin nodes and the "
                        f"wheel has only libtensorrt_rtx.so.1; run with LD_LIBRARY_PATH={folder} (decodert made the "
                        f"link there) or link it once: ln -s libtensorrt_rtx.so.1 {libs / 'libtensorrt_rtx.so'}")


# ---------------------------------------------------------------- the plugin
def _plugin_class(trt: ModuleType) -> type:
    """DecodertPlugin for this TensorRT module (the bases come from the module)."""
    if id(trt) in _CLASSES:
        return _CLASSES[id(trt)]
    _CLASSES[id(trt)] = make_plugin_class(trt)
    return _CLASSES[id(trt)]


def _creator(trt: ModuleType, op: OpDef, namespace: str) -> Any:
    plugin_class = _plugin_class(trt)

    class Creator(trt.IPluginCreatorV3One):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = op.name, namespace, VERSION
            self.field_names = plugin_fields(trt, op, None)

        def create_plugin(self, name: str, fc: Any, phase: Any) -> Any:
            attrs = attrs_from_fields(op, name, fc)
            return plugin_class(trt, op, attrs, namespace)

    return Creator()


def enable_plugin_features(trt: ModuleType, config: Any) -> None:
    """Builder settings the decodert plugins need: aliased plugin I/O (present_* = past_* buffers)."""
    feature = getattr(getattr(trt, "PreviewFeature", None), "ALIASED_PLUGIN_IO_10_03", None)
    if feature is None:
        raise DecodertError("this TensorRT cannot alias plugin outputs to inputs (PreviewFeature."
                            "ALIASED_PLUGIN_IO_10_03, TensorRT >= 10.3): the in-place KV cache plugin needs it")
    config.set_preview_feature(feature, True)


def register_plugins(trt: ModuleType | None = None, info: Any = None) -> list[str]:
    """Register every TRT_OPS creator once per process; returns "namespace::name" of each registered."""
    if trt is None or info is None:
        from decodert.plugins.trt.compat import load_trt

        trt, info = load_trt()
    check_plugin_loader(info)
    registry = trt.get_plugin_registry()
    done = []
    for name in TRT_OPS:
        op = get_op(name)
        for namespace in NAMESPACES:
            key = (id(trt), name, namespace)
            if key not in _KEEP:
                creator = _creator(trt, op, namespace)
                if not registry.register_creator(creator, namespace):
                    raise DecodertError(f"TensorRT refused to register plugin {namespace}::{name} (registered twice?)")
                _KEEP[key] = creator
            done.append(f"{namespace}::{name}")
    return done
