"""The model names one server answers to, and their ``/v1/models`` cards.

- The base model answers to ``config.model_name`` and to every alias (``--served-model-name A B C``: the
  first is the name, the others aliases); each is listed, each is accepted, and a reply echoes the name asked.
- A LoRA adapter NAME answers to "MODEL:NAME" (MODEL: any name of the base) and to "NAME" (as vLLM); it is
  listed once, under the first name.
- With ``accept_any_model`` (``--accept-any-model``) any other name means the base model (for clients that
  hard-code one); it is never listed. Without it an unknown name is a 404 model_not_found, as OpenAI's API.
- ``created`` is when the artifact was exported: the manifest's ``created``, else manifest.json's mtime.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from decodert.serve.api_error import ApiError


def served_names(config: Any) -> tuple[str, ...]:
    """The base model's names: the first, then the aliases, each once."""
    return tuple(dict.fromkeys((config.model_name, *config.aliases)))


def check_model(name: str, config: Any, engine: Any) -> str | None:
    """The request's model -> the LoRA adapter it names (None: the base model); ApiError 404 otherwise."""
    names = served_names(config)
    if name in names:
        return None
    adapters = engine.llm.adapters.names
    base, _, adapter = name.rpartition(":")
    if base in names and adapter in adapters:
        return adapter
    if name in adapters:
        return name
    if config.accept_any_model:
        return None
    served = ", ".join(repr(n) for n in [*names, *(f"{names[0]}:{a}" for a in adapters)])
    raise ApiError(404, f"the model {name!r} does not exist; this server serves {served}",
                   param="model", code="model_not_found")


def model_card(engine: Any, config: Any, name: str, adapter: str | None = None) -> dict[str, Any]:
    """The card of the base model under ``name``, or of a LoRA adapter ("NAME:ADAPTER", its parent ``name``)."""
    card = {"id": name, "object": "model", "created": config.created, "owned_by": "decodert",
            "max_model_len": engine.llm.max_seq}
    if adapter is not None:
        card.update(id=f"{name}:{adapter}", parent=name, root=engine.llm.adapters.info(adapter).source)
    return card


def model_list(engine: Any, config: Any) -> list[dict[str, Any]]:
    names = served_names(config)
    return ([model_card(engine, config, n) for n in names]
            + [model_card(engine, config, names[0], a) for a in engine.llm.adapters.names])


def card_for(name: str, engine: Any, config: Any) -> dict[str, Any]:
    """``GET /v1/models/{name}``: the card the name resolves to (an accepted unknown name: the base model's)."""
    adapter = check_model(name, config, engine)
    names = served_names(config)
    if adapter is None:
        return model_card(engine, config, name if name in names else names[0])
    base = name.rpartition(":")[0]
    return model_card(engine, config, base if base in names else names[0], adapter)


def created_time(folder: Path | str, manifest: Any) -> int:
    """Unix seconds the artifact was exported: the manifest's ISO ``created``, else manifest.json's mtime (0: neither)."""
    stamp = getattr(manifest, "created", None)
    if stamp:
        try:
            when = dt.datetime.fromisoformat(stamp)
            return int((when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp())
        except ValueError:
            pass
    try:
        return int((Path(folder) / "manifest.json").stat().st_mtime)
    except OSError:
        return 0
