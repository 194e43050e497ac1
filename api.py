"""``decodert.LLM``: the façade above export and runtime, what ``from decodert import LLM`` gives.

    llm = LLM.load("smollm2")                         # a checkpoint: exported once into the cache, then opened
    llm = LLM.load("model.gguf", max_seq=512, quant="int8")
    llm = LLM.load("out/smollm2")                     # an artifact folder: opened as it is

The runtime's ``LLM`` (runtime/llm.py) opens artifact folders only, and runtime never imports export; this
subclass puts export-on-first-load (export/prepare.py) in front of it, for the model and for ``draft=`` alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from decodert.export.prepare import prepare_model
from decodert.runtime import llm as runtime_llm


class LLM(runtime_llm.LLM):
    @classmethod
    def load(cls, path: str | Path, backend: str = "auto", verify: str = "fast",
             draft: str | Path | None = None, prefix_cache_mb: float | None = None,
             tool_parser: str | None = None, adapters: Mapping[str, str | Path] | None = None, *,
             max_seq: int | None = None, quant: str = "auto", cache_dir: str | Path | None = None,
             cache_dir_gb: float | None = None, placement: Any = "auto") -> "LLM":
        """Open a model: what ``decodert run`` accepts. ``path``: an artifact folder, or a checkpoint that is
        exported once into the cache ($DECODERT_CACHE, ~/.cache/decodert) and reused: "smollm2" (the bundled
        SmolLM2-135M-Instruct), a .gguf file or an HF folder. ``max_seq`` (default min(context, 2048)) and
        ``quant`` ("auto": the checkpoint's own precision; "none" = fp32, "int4", "int8") choose that export;
        for an artifact folder they must agree with it. ``draft`` is opened by this same method (the runtime's
        ``load`` calls ``cls.load``), so it may be a checkpoint too. The other arguments: runtime/llm.py ``LLM.load``."""
        folder = prepare_model(path, max_seq=max_seq, quant=quant)
        return super().load(folder, backend, verify, draft, prefix_cache_mb, tool_parser, adapters,
                            cache_dir=cache_dir, cache_dir_gb=cache_dir_gb, placement=placement)
