"""Continuous batching: admit waiting requests into free cache slots while others keep decoding.

Active rows are kept compact in slots ``0 .. n_active-1``: when a row finishes, the last active
row is moved into its slot (``backend.move_slot``), so every decode call runs exactly the
unfinished rows and finished rows cost nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence as Seq

from decodert.runtime.speculation import speculative
from decodert.runtime.backends.backend import Backend, KVCache
from decodert.runtime.decoding.generate import Sequence, decode_step, prefill


def run(backend: Backend, cache: KVCache, seqs: Seq[Sequence] | Mapping[int, Sequence],
        active: list[int] | None = None,
        admit: Callable[[], Iterable[int]] | None = None, prefix: Any = None) -> Iterator[tuple[int, str]]:
    """Yield ``(request index, text delta)`` once per generated token, until every request is done.

    Each loop turn either prefills the waiting requests that fit into free slots (one call for
    all of them) or, when none can be admitted, runs one decode step over all active rows.
    Deltas may be "" (text held back); ``seqs[i].done`` tells when request ``i`` finished.

    ``active`` (``active[slot]`` = request index; slots ``0 .. len(active)-1`` are in use) is the
    slot table; pass a list to watch it. However the run ends (done, closed, or an exception such
    as KeyboardInterrupt from a step), every slot it used is reset and the table is left empty.

    ``admit`` makes the run open to new requests (runtime/decoding/engine.py): called at the start of every
    turn, it returns the indices of requests it has just put into ``seqs`` (then a dict), and it may
    finish any request (a cancel): a finished request is never prefilled, and its slot is freed
    before the turn's step. By the time ``admit`` runs, every request yielded as done (or finished
    by an earlier call) has left its slot, so ``admit`` may delete it from ``seqs``.

    ``prefix`` (runtime/prefix_cache.py): prompts start from their longest cached prefix, and a
    finished row's whole blocks (prompt and generated) are kept before its slot is reused. New
    rows that share an uncached prefix are prefilled after the first of them, so it runs once.
    """
    active = [] if active is None else active
    assert not active, "the slot table of a new run must be empty"
    waiting = deque(range(len(seqs)))
    try:
        while True:
            _compact(backend, cache, active, seqs, prefix)
            if admit is not None:
                waiting.extend(admit())
                _compact(backend, cache, active, seqs, prefix)  # the rows admit finished (cancelled)
            new = _take(waiting, seqs, cache.slots - len(active))
            if new:
                first = len(active)
                active.extend(new)
                for group in _admission_groups([seqs[i] for i in new], prefix, cache.has_state):
                    slots = [first + j for j in group]
                    for slot in slots:
                        cache.reset(slot)
                    deltas = prefill(backend, cache, slots, [seqs[new[j]] for j in group], prefix)
                    yield from zip([new[j] for j in group], deltas)
            elif active:
                rows_now = [seqs[i] for i in active]
                if any(s.spec is not None for s in rows_now):  # drain: nobody waits for a slot
                    deltas = speculative.step(backend, cache, range(len(active)), rows_now,
                                              drain=admit is None and not waiting)
                else:
                    deltas = decode_step(backend, cache, range(len(active)), rows_now)
                yield from zip(list(active), deltas)
            else:
                return
    finally:
        for slot in range(len(active)):
            cache.reset(slot)
        active.clear()


def _take(waiting: deque, seqs: Seq[Sequence] | Mapping[int, Sequence], free: int) -> list[int]:
    """Pop up to ``free`` unfinished requests from ``waiting`` (finished ones are dropped)."""
    new: list[int] = []
    while waiting and len(new) < free:
        i = waiting.popleft()
        if not seqs[i].done:
            new.append(i)
    return new


def _admission_groups(new: Seq[Sequence], prefix: Any, states: bool = False) -> list[list[int]]:
    """Positions in ``new`` to prefill together: one call, or two when some prompts share an
    uncached first block with an earlier one (those wait one call and load it from the cache;
    ``states``: a hybrid model's, whose shared part must have a state stored)."""
    if prefix is None or len(new) < 2:
        return [list(range(len(new)))]
    leaders, followers = prefix.split_shared([s.prompt for s in new], states)
    return [leaders, followers] if followers else [leaders]


def _compact(backend: Backend, cache: KVCache, active: list[int], seqs: Seq[Sequence] | Mapping[int, Sequence],
             prefix: Any = None) -> None:
    """Drop finished rows from ``active`` (in place), filling each hole with the last active row."""
    finished = [slot for slot, i in enumerate(active) if seqs[i].done]
    if prefix is not None:
        for slot in finished:  # before any move overwrites a finished row
            prefix.store(cache, slot)  # what the row holds, as the cache records it
    for slot in reversed(finished):  # descending: every slot above ``slot`` is unfinished by now
        last = len(active) - 1
        if slot != last:
            backend.move_slot(cache, last, slot)
            active[slot] = active[last]
        active.pop()
        cache.reset(last)  # the freed slot holds nothing: lengths of free slots are always 0
