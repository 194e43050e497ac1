"""Which rows run in the next step: slots of the shared cache (free, running), rows pinned by sessions, admission.

The shared cache has ``slots`` rows. Running requests are kept compact in slots ``0 .. n-1``: when one
finishes, the last running row moves into its slot (``backend.move_slot``), so a decode step runs exactly
the unfinished rows. A request waits in ``waiting`` until a slot is free.

A session pins a ``Row``: a cache of its own (one slot) that keeps its conversation's K/V between turns
and runs at most one request at a time; it never takes a shared slot.

Each step is one of (in this order of preference, pinned rows taking every other turn when both have work):
- admission: the waiting requests that fit into free slots, prefilled together (in two groups when some
  share an uncached prefix with an earlier one: those wait one call and load it from the prefix cache);
- a decode step of every running row;
- a pinned row's prefill or decode step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from decodert.runtime.engine.request import Handle


class Row:
    """A cache row pinned by a session (``Engine.pin``): its own one-slot cache, one request at a time.
    ``store_prefix``: whether this row's prefill stores its prompt blocks in the shared prefix cache (a
    session's first turn does: its system prompt; later turns would fill it with one conversation)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache  # KVCache of one slot (runtime/backends/kv_cache.py)
        self.handle: Handle | None = None  # the request running on it
        self.started = False  # its prompt is prefilled
        self.store_prefix = True

    @property
    def length(self) -> int:
        """Tokens whose K/V the row holds."""
        return int(self.cache.lengths[0])


@dataclass
class Work:
    """One step's work: ``kind`` "admit" (prefill ``groups`` of new rows at ``slots``), "decode" (the shared
    running rows) or "row" (a pinned row's next call)."""

    kind: str
    handles: list[Handle] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)  # admit: positions in ``handles`` per prefill call
    slots: list[int] = field(default_factory=list)  # admit / decode: the shared slot of each handle
    row: Row | None = None


class Scheduler:
    """The slot table, the waiting queue and the pinned rows (see the module docstring)."""

    def __init__(self, slots: int, prefix: Any = None) -> None:
        self.slots = slots
        self.prefix = prefix  # runtime/prefix_cache.py: decides admission groups; None: off
        self.waiting: deque[Handle] = deque()
        self.running: list[Handle] = []  # running[slot]: the request in shared slot ``slot``
        self.rows: list[Row] = []  # pinned rows that hold a request
        self._rows_turn = False  # alternate pinned rows with shared work

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.rows)

    def queue(self, handle: Handle) -> None:
        if handle.row is not None:
            handle.row.handle, handle.row.started = handle, False
            self.rows.append(handle.row)
        else:
            self.waiting.append(handle)

    def next(self, has_state: bool) -> Work | None:
        """The next step's work, or None when nothing is left. ``has_state``: the cache keeps hybrid states
        (a shared prefix must then have a state stored before followers load it)."""
        shared_work = bool(self.running) or any(not h.done for h in self.waiting)
        if self.rows and (not shared_work or self._rows_turn):
            self._rows_turn = False
            row = self.rows.pop(0)
            self.rows.append(row)  # round robin among pinned rows
            return Work("row", [row.handle], row=row)  # type: ignore[list-item]
        self._rows_turn = bool(self.rows)
        return self._shared(has_state)

    def _shared(self, has_state: bool) -> Work | None:
        new: list[Handle] = []
        while self.waiting and len(self.running) + len(new) < self.slots:
            h = self.waiting.popleft()
            if not h.done:
                new.append(h)
        if new:
            first = len(self.running)
            self.running.extend(new)
            return Work("admit", new, self._groups(new, has_state), list(range(first, first + len(new))))
        if self.running:
            return Work("decode", list(self.running), slots=list(range(len(self.running))))
        return None

    def _groups(self, new: list[Handle], has_state: bool) -> list[list[int]]:
        if self.prefix is None or len(new) < 2:
            return [list(range(len(new)))]
        leaders, followers = self.prefix.split_shared([h.seq.prompt for h in new], has_state)
        return [leaders, followers] if followers else [leaders]

    def finished_slots(self) -> list[int]:
        """Shared slots whose request is done, ascending."""
        return [slot for slot, h in enumerate(self.running) if h.done]

    def vacate(self, slot: int) -> int:
        """Take the request out of ``slot``, moving the last running one into it -> the slot that moved
        (``slot`` itself when it was the last). Callers move the cache row the same way."""
        last = len(self.running) - 1
        if slot != last:
            self.running[slot] = self.running[last]
        self.running.pop()
        return last

    def unpin(self, row: Row) -> None:
        """The row's request is over (done or dropped): the row keeps its K/V, holds no request."""
        row.handle, row.started = None, False
        if row in self.rows:
            self.rows.remove(row)

    def handles(self) -> list[Handle]:
        """Every request queued or running, pinned rows' included."""
        return list(self.waiting) + list(self.running) + [r.handle for r in self.rows if r.handle is not None]

    def drop_all(self) -> list[Handle]:
        """Forget every request (a step failed): -> the ones dropped; the caller resets the shared slots."""
        dropped = self.handles()
        self.waiting.clear()
        self.running.clear()
        for row in list(self.rows):
            self.unpin(row)
        return dropped
