"""Model families: one small file each, looked up by HF `model_type` or GGUF `general.architecture`.

A family file is any module of ``models/families/``; what it declares is the ``Family`` protocol
(models/family.py: ``MODEL_TYPES``, ``spec_from_hf``, ``HF_WEIGHTS``, and the optional parts), checked here
when the registry is built, so adding a family is adding its file (docs/features/families.md): no table lists it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from decodert.errors import DecodertError
from decodert.models import families as _families_package
from decodert.models.family import Family


@functools.cache
def registry() -> dict[str, Family]:
    """Every declared name (lower case) -> its family; a name two families claim, or a family file missing a
    part of the protocol, is a bug (TypeError / RuntimeError naming the file)."""
    names: dict[str, Family] = {}
    prefix = _families_package.__name__ + "."
    for info in sorted(pkgutil.iter_modules(_families_package.__path__, prefix), key=lambda m: m.name):
        if info.ispkg or info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        family = Family.of(importlib.import_module(info.name))
        for name in (*family.model_types, *family.gguf_architectures):
            other = names.setdefault(name.lower(), family)
            if other is not family:
                raise RuntimeError(f"'{name}' is declared by both {other.module.__name__} and {family.module.__name__}")
    return names


def family_names() -> tuple[str, ...]:
    """The family names (file names), sorted."""
    return tuple(sorted({f.name for f in registry().values()}))


def families() -> tuple[Family, ...]:
    """Every family, by name."""
    return tuple(sorted({f.name: f for f in registry().values()}.values(), key=lambda f: f.name))


def family_for(model_type: str, source: str = "the checkpoint") -> Family:
    """The family (models/family.py) for a model_type / GGUF architecture."""
    family = registry().get(str(model_type).lower())
    if family is None:
        raise DecodertError(
            f"unknown architecture '{model_type}' in {source}; supported: {', '.join(family_names())}"
        )
    return family
