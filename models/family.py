"""What a family file (``models/families/<family>.py``) provides: the ``Family`` protocol, checked when the registry
(models/__init__.py) is built, so a file missing a required part fails at import with a message naming it.

A family file is a plain module; its names are the protocol's, upper case for tables, lower case for functions:

    required   MODEL_TYPES                 config.json model_type values
               spec_from_hf(config)        config.json dict -> ModelSpec (its layers declared by kind, models/layers/)
               HF_WEIGHTS                  canonical name -> checkpoint key(s) (models/canonical.py)
    GGUF       GGUF_ARCHITECTURES          general.architecture values; with them, required:
               spec_from_gguf(meta), GGUF_WEIGHTS
    optional   TAGS                        capabilities: "moe", "hybrid", "vision" (for listings and tests)
               sanitize(key) -> key | None a stored key as the table names it (None: the key is dropped)
               hf_fix / gguf_fix(key, w, spec) -> w      a tensor's family quirk, applied as it is read
               gguf_shape(key, shape) -> shape           a GGUF tensor's stored shape as the checkpoint's
               gguf_rope_freqs(spec, meta, factors) -> spec   a GGUF's rope_freqs.weight read into the spec
               HF_UNUSED, GGUF_UNUSED      regexes of stored keys no canonical weight reads
    vision     vision_from_hf(config) -> VisionSpec | None, VISION_WEIGHTS (required together, tag "vision");
               vision_fix(name, w), image_processor(...), video_processor(config)
    audio      audio_from_hf(config) -> the spec of its encoder kind (models/audio.py KINDS) | None, AUDIO_WEIGHTS,
               audio_features(preprocessor, audio) (required together, tag "audio"); audio_fix(name, w);
               TRANSCRIPTION: the transcription request when it is not Qwen3-ASR's ({"instruction": text}: a user
               turn of the clip and the text, "instruction_language": the text for a forced language, its name
               ``{language}``; runtime/audio/transcribe.py)
    enc-dec    ENCODER_DECODER = True: an encoder-decoder model (Whisper): spec_from_hf returns the family's own
               frozen spec, HF_WEIGHTS names the encoder's and the decoder's weights, and export/seq2seq_export.py
               writes its graphs (not the decoder-only recipe of export/lowering/graph.py); with it, required:
               window_features(preprocessor, spec) (log-mel settings), generation(config, generation_config)

Callers read a ``Family``'s attributes, each with its default, never the module's with ``getattr``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

TAGS = ("moe", "hybrid", "vision", "audio")
Table = Mapping[str, Any]  # canonical name template -> checkpoint key template(s)


@dataclass(frozen=True)
class Family:
    """A family file's declarations (``Family.of(module)``); the optional parts default to "none"."""

    name: str  # the file's name
    module: ModuleType
    model_types: tuple[str, ...]
    spec_from_hf: Callable[[dict], Any]
    hf_weights: Table
    gguf_architectures: tuple[str, ...] = ()
    spec_from_gguf: Callable[[dict], Any] | None = None
    gguf_weights: Table = field(default_factory=dict)
    tags: frozenset[str] = frozenset()
    sanitize: Callable[[str], str | None] | None = None
    hf_fix: Callable[..., Any] | None = None
    gguf_fix: Callable[..., Any] | None = None
    gguf_shape: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None
    gguf_rope_freqs: Callable[..., Any] | None = None
    hf_unused: tuple[str, ...] = ()
    gguf_unused: tuple[str, ...] = ()
    vision_from_hf: Callable[[dict], Any] | None = None
    vision_weights: Table = field(default_factory=dict)
    vision_fix: Callable[..., Any] | None = None
    image_processor: Callable[..., Any] | None = None
    video_processor: Callable[[dict], Any] | None = None
    audio_from_hf: Callable[[dict], Any] | None = None
    audio_weights: Table = field(default_factory=dict)
    audio_features: Callable[..., Any] | None = None
    audio_fix: Callable[..., Any] | None = None
    transcription: Table = field(default_factory=dict)
    encoder_decoder: bool = False
    window_features: Callable[..., Any] | None = None
    generation: Callable[..., Any] | None = None

    @classmethod
    def of(cls, module: ModuleType) -> "Family":
        """The declarations of family file ``module``; TypeError naming the file and the part that is missing
        or of the wrong kind."""
        name = module.__name__.rsplit(".", 1)[-1]
        values: dict[str, Any] = {"name": name, "module": module}
        for f in dataclasses.fields(cls)[2:]:
            declared = f.name.upper() if f.name in _TABLES else f.name
            if hasattr(module, declared):
                values[f.name] = getattr(module, declared)
            elif f.name in _REQUIRED:
                raise TypeError(f"family file {module.__name__} declares no {declared} (models/family.py: "
                                f"every family declares {', '.join(_declared(n) for n in _REQUIRED)})")
        values["tags"] = frozenset(values.get("tags", ()))
        family = cls(**values)
        family._check()
        return family

    def _check(self) -> None:
        where = f"family file {self.module.__name__}"
        for part in ("model_types", "gguf_architectures", "hf_unused", "gguf_unused"):
            value = getattr(self, part)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{where}: {_declared(part)} must be a tuple of strings")
        if not self.model_types:
            raise TypeError(f"{where}: MODEL_TYPES names no model_type")
        for part in ("hf_weights", "gguf_weights", "vision_weights", "audio_weights"):
            if not isinstance(getattr(self, part), Mapping):
                raise TypeError(f"{where}: {_declared(part)} must be a dict of canonical names")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "module") and f.type.startswith("Callable") and value is not None \
                    and not callable(value):
                raise TypeError(f"{where}: {f.name} must be a function")
        if not self.hf_weights:
            raise TypeError(f"{where}: HF_WEIGHTS is empty")
        if self.gguf_architectures and (self.spec_from_gguf is None or not self.gguf_weights):
            raise TypeError(f"{where}: GGUF_ARCHITECTURES needs spec_from_gguf and GGUF_WEIGHTS")
        if (self.vision_from_hf is None) != (not self.vision_weights):
            raise TypeError(f"{where}: vision_from_hf and VISION_WEIGHTS come together")
        if not ((self.audio_from_hf is None) == (not self.audio_weights) == (self.audio_features is None)
                == ("audio" not in self.tags)):
            raise TypeError(f"{where}: audio_from_hf, AUDIO_WEIGHTS and audio_features come together, tagged 'audio'")
        if not isinstance(self.encoder_decoder, bool):
            raise TypeError(f"{where}: ENCODER_DECODER must be True or False")
        if self.encoder_decoder != (self.window_features is not None) or \
                self.encoder_decoder != (self.generation is not None):
            raise TypeError(f"{where}: ENCODER_DECODER = True, window_features and generation come together")
        unknown = sorted(self.tags - set(TAGS))
        if unknown:
            raise TypeError(f"{where}: TAGS '{unknown[0]}' is not one of {', '.join(TAGS)}")
        if (self.vision_from_hf is not None) != ("vision" in self.tags):
            raise TypeError(f"{where}: a family with a vision tower (vision_from_hf) is tagged 'vision', and only it")


_TABLES = {"model_types", "hf_weights", "gguf_architectures", "gguf_weights", "tags", "hf_unused", "gguf_unused",
           "vision_weights", "audio_weights", "encoder_decoder", "transcription"}  # declared in upper case
_REQUIRED = ("model_types", "spec_from_hf", "hf_weights")


def _declared(part: str) -> str:
    return part.upper() if part in _TABLES else part
