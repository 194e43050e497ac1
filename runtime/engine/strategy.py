"""How one decode step of the running rows is taken: plainly, or speculatively (draft, then one verify pass).

The scheduler decides *which* rows step; a ``StepStrategy`` decides *how*. It sees only this interface:

    strategy.step(backend, cache, slots, seqs, drain) -> one text delta per row

``PlainStep`` feeds each row's last token (runtime/decoding/generate.py ``decode_step``); ``SpeculativeStep``
drafts for the rows that asked for it and verifies them in one pass (runtime/speculation/speculative.py), the
others decoding one token in the same pass. ``strategy_for`` picks one for a set of rows.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence as Seq

from decodert.runtime.decoding.generate import Sequence, decode_step
from decodert.runtime.speculation import speculative


class StepStrategy(Protocol):
    def step(self, backend: Any, cache: Any, slots: Seq[int], seqs: Seq[Sequence], drain: bool) -> list[str]:
        """Advance every row by at least one token -> one text delta per row ("" when text is held back).
        ``drain``: no request waits for a slot (the speculation planner then favours the last row's end)."""
        ...


class PlainStep:
    def step(self, backend: Any, cache: Any, slots: Seq[int], seqs: Seq[Sequence], drain: bool) -> list[str]:
        return decode_step(backend, cache, slots, seqs)


class SpeculativeStep:
    def step(self, backend: Any, cache: Any, slots: Seq[int], seqs: Seq[Sequence], drain: bool) -> list[str]:
        return speculative.step(backend, cache, slots, seqs, drain=drain)


PLAIN, SPECULATIVE = PlainStep(), SpeculativeStep()


def strategy_for(seqs: Seq[Sequence]) -> StepStrategy:
    """Speculative when any row speculates (``seq.spec``: the drafter's state), else plain."""
    return SPECULATIVE if any(s.spec is not None for s in seqs) else PLAIN
