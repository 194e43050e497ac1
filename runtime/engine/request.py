"""What a client hands the engine: a prepared request, and the handle it gets back.

    prepared = llm.prepare("Hello", max_new_tokens=8)            # or llm.prepare(messages, tools=[...])
    handle = llm.engine.add(llm.engine.sequence(prepared))
    for h, delta in llm.engine.step(): ...                        # until handle.done

``Prepared`` is the one form every caller builds (``LLM.prepare``: the template, tools, images, constraint,
sampling); the engine turns it into a ``Sequence`` (validated against the model: length, vocabulary,
adapter, speculation) and runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.runtime.constraints import Constraint
from decodert.runtime.decoding.generate import Sequence
from decodert.runtime.decoding.sampling import SamplingParams

CANCELLED = "cancelled"  # finish_reason of a request cancelled before it finished


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: prompt ids and everything that decides how they are continued."""

    ids: np.ndarray  # [L] int64 prompt ids (image placeholders as image ids: runtime/vision/tokens.py)
    params: SamplingParams  # validated, the model's defaults under what the caller passed
    constraint: Constraint | None = None  # structured output (the tools' constraint merged in, for chat)
    speculative: Any = None  # "ngram" | "draft" | SpeculativeConfig | None
    adapter: str | None = None  # LoRA adapter name; None: the base model
    turn: Any = None  # chat: the ChatTurn (runtime/chat/turn.py) that splits the reply; None: a plain prompt
    text: str | None = None  # chat: the rendered prompt
    what: str = "prompt"  # how errors name it ("prompt 2", "request 0")

    @property
    def rendered(self) -> tuple[Any, str | None, np.ndarray]:
        """(chat turn, rendered prompt, ids): what a chat request renders to."""
        return self.turn, self.text, self.ids


class Handle:
    """A request in the engine: its sequence (text, tokens, ``done``) and, for a session, its pinned row."""

    __slots__ = ("id", "seq", "row")

    def __init__(self, rid: int, seq: Sequence, row: Any = None) -> None:
        self.id, self.seq, self.row = rid, seq, row

    @property
    def done(self) -> bool:
        return self.seq.done

    def __repr__(self) -> str:
        return f"Handle({self.id}, done={self.done})"
