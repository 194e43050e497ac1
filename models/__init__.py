"""Model families: one small file each, looked up by HF `model_type` or GGUF `general.architecture`.

A family file is any module of ``models/families/`` that declares
``MODEL_TYPES`` (config.json ``model_type`` values)
and ``GGUF_ARCHITECTURES`` (GGUF ``general.architecture`` values); the registry below is built
from those declarations, so adding a family is adding its file (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

from decodert.errors import DecodertError

from decodert.models import families as _families_package


@functools.cache
def registry() -> dict[str, ModuleType]:
    """Every declared name (lower case) -> its family module; a name two families claim is a bug."""
    names: dict[str, ModuleType] = {}
    prefix = _families_package.__name__ + "."
    for info in sorted(pkgutil.walk_packages(_families_package.__path__, prefix), key=lambda m: m.name):
        if info.ispkg or info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        module = importlib.import_module(info.name)
        for name in (*module.MODEL_TYPES, *module.GGUF_ARCHITECTURES):
            other = names.setdefault(name.lower(), module)
            if other is not module:
                raise RuntimeError(f"'{name}' is declared by both {other.__name__} and {module.__name__}")
    return names


def family_names() -> tuple[str, ...]:
    """The family names (file names), sorted."""
    return tuple(sorted({m.__name__.rsplit(".", 1)[-1] for m in registry().values()}))


def family_for(model_type: str, source: str = "the checkpoint") -> ModuleType:
    """The family module (``decodert.models.families.<family>``) for a model_type / GGUF architecture."""
    module = registry().get(str(model_type).lower())
    if module is None:
        raise DecodertError(
            f"unknown architecture '{model_type}' in {source}; supported: {', '.join(family_names())}"
        )
    return module
