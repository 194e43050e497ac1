"""The target's last hidden states per cache slot, what a draft head reads (runtime/speculation/heads.py).

A backend that keeps them (``keep_hidden()``, asked for by a head's drafter at load) binds its graphs' hidden-state
outputs (export/lowering/io_contract.hidden_outputs) to fixed buffers and, after each pass over a slot, stores the
rows of that pass: ``put(slot, start, rows)``, rows [w, hidden] for cache positions start..start+w-1 (prefill: every
position it ran, from its ``prompt_hidden``; decode: the last position; verify: every position fed). A rewind
needs nothing here: the drafter asks for the position before the row's pending token, which the last pass computed
whatever it kept. ``move`` follows the
backend's ``move_slot``; ``drop`` a slot that was reset. A position the last pass did not compute reads None
(the drafter then proposes nothing for that row: exactness never depends on it).
"""

from __future__ import annotations

import numpy as np


class HiddenRows:
    def __init__(self) -> None:
        self._rows: dict[int, tuple[int, np.ndarray]] = {}  # slot -> (first position, [w, hidden])

    def put(self, slot: int, start: int, rows: np.ndarray) -> None:
        self._rows[slot] = (int(start), np.array(rows, copy=True))

    def at(self, slot: int, position: int) -> np.ndarray | None:
        """[hidden] at cache position ``position`` of ``slot``, if its last pass computed it."""
        got = self._rows.get(slot)
        if got is None or not 0 <= position - got[0] < len(got[1]):
            return None
        return got[1][position - got[0]]

    def span(self, slot: int) -> tuple[int, np.ndarray] | None:
        """(first position, rows [w, hidden]) of ``slot``'s last pass, if any (an MTP head catches up over them)."""
        return self._rows.get(slot)

    def prepend(self, slot: int, start: int, earlier: np.ndarray) -> None:
        """Rows the caller knows are still the target's for positions start.. before ``slot``'s last pass (a hybrid
        row's replay runs the verify's accepted tokens again from the same state: their rows are the verify's)."""
        got = self._rows.get(slot)
        if got is not None and start <= got[0] <= start + len(earlier):
            self._rows[slot] = (int(start), np.concatenate([earlier[: got[0] - start], got[1]]))

    def move(self, src: int, dst: int) -> None:
        got = self._rows.pop(src, None)
        if got is None:
            self._rows.pop(dst, None)
        else:
            self._rows[dst] = got

    def drop(self, slot: int) -> None:
        self._rows.pop(slot, None)
