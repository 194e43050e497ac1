"""Model families: one small file each, looked up by HF `model_type` or GGUF `general.architecture`."""

from __future__ import annotations

import importlib
from types import ModuleType

from decodert.errors import DecodertError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

# Other spellings of the same families (GGUF Mistral files usually say "llama" already).
ALIASES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
}


def family_for(model_type: str, source: str = "the checkpoint") -> ModuleType:
    """The family module (``decodert.models.<family>``) for a model_type / GGUF architecture."""
    name = ALIASES.get(str(model_type).lower())
    if name is None:
        raise DecodertError(
            f"unknown architecture '{model_type}' in {source}; supported: {', '.join(FAMILIES)}"
        )
    return importlib.import_module(f"decodert.models.{name}")
