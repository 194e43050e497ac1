"""The engine: it owns every run of a model, from a prepared request to its last token.

    engine = llm.engine
    handle = engine.add(engine.sequence(llm.prepare("Hello", max_new_tokens=8)))
    while not handle.done:
        for h, delta in engine.step(): ...      # (handle, text delta) per row the step advanced
    engine.abort(handle, reason=None)            # drop a request (reason: finish it with that reason first)

One step is one backend call set, chosen by the scheduler (runtime/engine/scheduler.py): an admission
(prefill of new rows into free slots of the shared cache), a decode step of every running row (plainly or
speculatively: runtime/engine/strategy.py), or a session's pinned row. Finished rows leave their slots before
the next step; what a finished row holds (prompt and generated blocks) goes to the prefix cache first.

The engine is not thread-safe: one thread calls it at a time. ``LLM`` serialises its callers' runs
(runtime/engine/runs.py); a server drives it from one thread (runtime/engine/thread.py).

If a step raises (an error, KeyboardInterrupt), every request is dropped and every shared slot reset, then
the exception propagates: the next request starts on a clean cache. A pinned row keeps what it holds (its
cache owner's rule: the record always matches the K/V and states, runtime/backends/kv_cache.py).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Callable

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.decoding.generate import Sequence, prefill
from decodert.runtime.engine.request import Handle, Prepared
from decodert.runtime.engine.scheduler import Row, Scheduler, Work
from decodert.runtime.engine.strategy import strategy_for
from decodert.runtime.prefix_cache import LookupOnly
from decodert.runtime.speculation.speculative import SpeculativeConfig, resolve as resolve_speculative
from decodert.runtime.vision.tokens import is_image, text_ids


_noted_plain: list[bool] = []  # the one info line of speculation on a placement whose verify is not its decode's


class Engine:
    """A backend, its shared cache of ``backend.max_batch`` slots, the scheduler and what requests need to
    become sequences (the detokenizer, eos ids, structured-output compiler, adapters, drafters, images)."""

    def __init__(self, backend: Any, *, decoder: Any, eos_token_ids: tuple[int, ...], prefix_cache: Any = None,
                 speculator: Any = None, vision: Any = None, adapters: Any = None, audio: Any = None,
                 guidance: Callable[[], Any] | None = None, manifest: Any = None) -> None:
        self.backend = backend
        self.manifest = manifest  # the artifact's (its graphs name what the backend could not load)
        self.speculator = speculator  # runtime/speculation/speculative.py Speculator
        self.vision = vision  # runtime/vision/encoder.py Vision, or None (text only)
        self.audio = audio  # runtime/audio/encoder.py Audio (its rows in the same store as images), or None
        self.adapters = adapters  # runtime/adapters.py Adapters
        self.open = False  # the current run takes requests while it runs (a server's): speculation never drains
        self.eos_token_ids = tuple(eos_token_ids)  # a sequence stops at any of these
        self._decoder = decoder
        self._guidance = guidance  # () -> Guidance, built on the first constrained request
        self._cache: Any = None  # the shared cache, allocated on the first request
        self._scheduler = Scheduler(int(backend.max_batch), prefix_cache)
        self._prefix = prefix_cache
        self._ids = itertools.count()

    # -- state ---------------------------------------------------------------------------------------
    @property
    def cache(self) -> Any:
        """The shared KVCache (None until the first request)."""
        return self._cache

    @property
    def prefix_cache(self) -> Any:
        """The prefix cache (runtime/prefix_cache.py), or None: off."""
        return self._prefix

    @prefix_cache.setter
    def prefix_cache(self, prefix: Any) -> None:
        self._prefix = self._scheduler.prefix = prefix

    @property
    def slots(self) -> int:
        return int(self.backend.max_batch)

    @property
    def max_seq(self) -> int:
        return int(self.backend.max_seq)

    @property
    def slots_in_use(self) -> int:
        """Shared slots held by running requests."""
        return len(self._scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def idle(self) -> bool:
        """Nothing is waiting or running."""
        return self._scheduler.idle

    def unfinished(self) -> list[Handle]:
        """Every request queued or running, pinned rows' included."""
        return self._scheduler.handles()

    def release_cache(self) -> None:
        """Drop every request and the shared cache (``LLM.close``); a later request allocates again."""
        self._drop_all()
        self._cache = None

    # -- requests ------------------------------------------------------------------------------------
    def sequence(self, prepared: Prepared) -> Sequence:
        """A validated Sequence for a prepared request. DecodertError: empty, too long for the context, ids
        outside the vocabulary, an invalid constraint, an unknown adapter, speculation this model cannot do."""
        ids, params, what = np.asarray(prepared.ids, dtype=np.int64).reshape(-1), prepared.params, prepared.what
        vocab = self.backend.vocab_size
        if ids.size == 0:
            raise DecodertError(f"{what} is empty")
        if ids.size > self.max_seq - 1:
            raise DecodertError(f"{what} has {ids.size} tokens but the model was exported with --max-seq "
                                f"{self.max_seq}, which leaves no room to generate; re-export with a larger --max-seq")
        if is_image(ids).any() and self.vision is None and self.audio is None:
            raise DecodertError(f"{what} has image ids but this model takes no images or audio")
        if ids.min() < 0 or text_ids(ids).max() >= vocab:
            raise DecodertError(f"{what} has token ids outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise DecodertError(f"logit_bias has token ids outside the vocabulary [0, {vocab})")
        guide = None
        if prepared.constraint is not None:
            try:
                guide = self._guidance().guide(prepared.constraint)  # type: ignore[misc]
            except DecodertError as e:
                raise (DecodertError(f"{what}: {e}") if what != "prompt" else e) from None
        seq = Sequence(ids, params, self._decoder, self.eos_token_ids, self.max_seq, guide)
        placed = getattr(self.backend, "placement", None)  # runtime/backends/placement.py (ort backends)
        if placed is not None and placed.source in ("explicit", "measured", "cached"):
            seq.placement = " ".join(f"{p}={b}" for p, b in placed.phases.items())
        if prepared.turn is not None:  # a chat turn may end the reply early (a repeated tool call)
            seq.watch = prepared.turn.watcher(prepared.text or "")
        media = self.vision if self.vision is not None else self.audio
        if media is not None:  # its images' and clips' rows stay readable until it is done (runtime/vision/encoder.py)
            seq.images = media.store.pin(ids)
        if self.adapters is not None:
            try:
                seq.adapter = self.adapters.resolve(prepared.adapter)
            except DecodertError as e:
                raise (DecodertError(f"{what}: {e}") if what.startswith("request") else e) from None
        config = resolve_speculative(prepared.speculative)
        if config is not None and not params.logprobs:  # logprobs rows decode one token a step (docs/SERVING.md)
            self.check_speculation()
            seq.spec = self.speculator.state(config, seq)
        return seq

    def speculation(self, value: Any) -> SpeculativeConfig | None:
        """A ``speculative=`` value ("ngram" | "draft" | SpeculativeConfig | None) checked against this model
        (DecodertError: unknown method, no verify graph, no draft model)."""
        config = resolve_speculative(value)
        if config is not None:
            self.check_speculation()
            self.speculator.drafter(config)
            if not getattr(self.backend, "verify_matches_decode", True) and not _noted_plain:
                _noted_plain.append(True)
                print("decodert: info: speculation runs plain decode steps here: the decode step is placed on "
                      f"{self.backend.placed['decode']}, whose rounding the verify pass (ort) does not reproduce "
                      "(place decode=ort to speculate: --placement prefill=...,decode=ort)", file=sys.stderr)
        return config

    def check_speculation(self) -> None:
        """DecodertError unless the backend has a verify pass (speculative decoding needs one)."""
        backend = self.backend
        if not hasattr(backend, "verify"):
            raise DecodertError(f"the {backend.name} backend has no verify pass; speculative decoding "
                                "runs on the ort and trt backends")
        if not getattr(backend, "verify_width", 0):
            if self.manifest is not None and "verify" in self.manifest.graphs:  # trt: engines built before it
                raise DecodertError("this artifact has no verify engine (built before speculative decoding); "
                                    "run `decodert build` on it again to use speculative decoding")
            raise DecodertError("this artifact has no verify graph (exported before speculative decoding); "
                                "re-export it to use speculative decoding")

    def add(self, seq: Sequence, row: Row | None = None) -> Handle:
        """Queue a sequence (``row``: a session's pinned row, which must be free) -> its handle."""
        if row is not None and row.handle is not None:
            raise DecodertError("this session row already runs a request")
        if row is None:
            self.reserve()
        handle = Handle(next(self._ids), seq, row)
        self._scheduler.queue(handle)
        return handle

    def reserve(self) -> None:
        """Allocate the shared cache now, if it is not (``add`` does on the first request). DecodertError naming
        --max-batch / --max-seq when it cannot fit; nothing is queued then. A server reserves at start, so that an
        artifact whose cache cannot be allocated is refused before it listens, not at its first request."""
        if self._cache is None:
            self._cache = self.backend.allocate(self.slots)

    def abort(self, handle: Handle, reason: str | None = None) -> None:
        """End a request between steps. ``reason`` (e.g. "cancelled"): it finishes with that reason and leaves
        like a finished row (its blocks go to the prefix cache); None: it is dropped, nothing of it is kept."""
        seq = handle.seq
        if reason is not None and not seq.done:
            seq.finish_reason = reason
        s = self._scheduler
        if handle.row is not None:
            if handle.row.handle is handle:
                s.unpin(handle.row)
            return
        if handle in s.waiting:
            s.waiting.remove(handle)
            return
        if handle in s.running:
            if seq.done:
                self.settle()
            else:
                self._vacate(s.running.index(handle))

    # -- session rows --------------------------------------------------------------------------------
    def pin(self) -> Row:
        """A cache row of its own for a session (one slot, allocated now)."""
        return Row(self.backend.allocate(1))

    # -- stepping ------------------------------------------------------------------------------------
    def step(self) -> list[tuple[Handle, str]]:
        """Run one step -> (handle, text delta) for each row it advanced ([] when nothing is left).
        A handle whose ``done`` is set has finished; its slot is free before the next step."""
        s = self._scheduler
        self.settle()
        work = s.next(self._cache is not None and self._cache.has_state)
        if work is None:
            return []
        try:
            if work.kind == "row":
                return self._step_row(work)
            if work.kind == "admit":
                return self._admit(work)
            return self._decode(work)
        except BaseException:
            self._drop_all()
            raise

    def _admit(self, work: Work) -> list[tuple[Handle, str]]:
        events: list[tuple[Handle, str]] = []
        for group in work.groups:
            handles = [work.handles[j] for j in group]
            slots = [work.slots[j] for j in group]
            for slot in slots:
                self._cache.reset(slot)
            deltas = prefill(self.backend, self._cache, slots, [h.seq for h in handles], self.prefix_cache)
            events += zip(handles, deltas)
        return events

    def _decode(self, work: Work) -> list[tuple[Handle, str]]:
        seqs = [h.seq for h in work.handles]
        drain = not self.open and not self._scheduler.waiting
        deltas = strategy_for(seqs).step(self.backend, self._cache, work.slots, seqs, drain)
        return list(zip(work.handles, deltas))

    def _step_row(self, work: Work) -> list[tuple[Handle, str]]:
        row, handle = work.row, work.handles[0]
        assert row is not None
        seq = handle.seq
        if not row.started:
            prefix = self.prefix_cache
            if prefix is not None and not row.store_prefix:
                prefix = LookupOnly(prefix)
            delta = prefill(self.backend, row.cache, [0], [seq], prefix)[0]
            row.started = True
        else:  # a session's turn never drains: its planner weighs the step as one row among others would
            delta = strategy_for([seq]).step(self.backend, row.cache, [0], [seq], False)[0]
        if seq.done:
            self._scheduler.unpin(row)
        return [(handle, delta)]

    def settle(self) -> None:
        """Finished rows leave their slots: their blocks are stored first, then the last rows move in. ``step``
        does it first; a run that ends calls it so that what it held is free without another step."""
        s = self._scheduler
        finished = s.finished_slots()
        if self.prefix_cache is not None:
            for slot in finished:  # before any move overwrites a finished row
                self.prefix_cache.store(self._cache, slot)  # what the row holds, as the cache records it
        for slot in reversed(finished):  # descending: every slot above ``slot`` is unfinished by now
            self._vacate(slot)

    def _vacate(self, slot: int) -> None:
        last = self._scheduler.vacate(slot)
        if last != slot:
            self.backend.move_slot(self._cache, last, slot)
        self._cache.reset(last)  # the freed slot holds nothing: lengths of free slots are always 0

    def _drop_all(self) -> None:
        self._scheduler.drop_all()
        if self._cache is not None:
            self._cache.reset()

