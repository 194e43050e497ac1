"""A thread that drives an LLM's engine for many callers: requests from any thread join its batch between steps.

    worker = EngineThread(llm, max_queue=64).start()
    seq = worker.sequence(llm.prepare("Hello", max_new_tokens=32))
    handle = worker.submit(seq, sink)      # sink(Event) is called on the engine thread
    handle.cancel()                        # finished "cancelled"; its slot is freed before the next step
    worker.stop(drain_s=30)                # no new requests; wait for the rest, then cancel them

The thread runs one run of the LLM's engine (runtime/engine/runs.py) per busy period with an ``admit``
hook: before every step (an admission of new rows, one decode step of all running rows) the hook adds the
submitted requests to the engine (``Engine.add``) and applies cancellations (``Engine.abort``). When nothing
is left, the run ends and the thread sleeps until the next ``submit``. Nothing is retried: a request the engine
cannot take (``Engine.add`` raises, e.g. the shared cache cannot be allocated) ends at once with an error event, the
others going on; a step that raises ends every request of its run so; a run that fails before it took any request
ends the waiting ones. Callers never wait for a step: ``submit`` and
``cancel`` only take a lock for a few list operations, and a sink must not block either (the
server's sink hands the event to its asyncio loop).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from decodert.errors import DecodertError, first_line
from decodert.runtime.decoding.generate import GenerationResult, Sequence
from decodert.runtime.engine.request import CANCELLED, Handle as EngineHandle, Prepared
from decodert.runtime.speculation.speculative import SpeculativeConfig


@dataclass(frozen=True)
class Event:
    """What a request's sink receives: text deltas, then one last event with ``result`` or ``error``."""

    text: str = ""  # newly generated text ("" on a last event that adds none)
    result: GenerationResult | None = None  # the finished request (last event)
    error: str | None = None  # one-line reason the engine failed the request (last event)
    logprobs: tuple = ()  # TokenLogprob of the tokens since the last event (logprobs=True; with held-back text too)

    @property
    def last(self) -> bool:
        return self.result is not None or self.error is not None


Sink = Callable[[Event], None]


class QueueFull(DecodertError):
    """Every slot is busy and ``max_queue`` requests already wait (a server answers 429)."""


class EngineClosed(DecodertError):
    """The engine is stopping or stopped and takes no new requests (a server answers 503)."""


@dataclass
class EngineStats:
    """Counters since the engine started (read from any thread; written by the engine thread only)."""

    steps: int = 0  # prefill and decode calls
    rows: int = 0  # rows over all steps: rows / steps is the mean batch occupancy
    max_rows: int = 0  # most rows one step ran
    finished: int = 0  # requests that ended (any reason, cancelled included)
    cancelled: int = 0
    failed: int = 0  # requests ended by an error of a step


@dataclass
class _Request:
    id: int
    seq: Sequence
    sink: Sink
    handle: EngineHandle | None = None  # once added to the engine
    logprobs_sent: int = 0  # seq.logprobs entries already sent in events


class Handle:
    """A submitted request: ``cancel()`` it from any thread."""

    def __init__(self, engine: "EngineThread", rid: int) -> None:
        self._engine, self.id = engine, rid

    def cancel(self) -> None:
        self._engine.cancel(self.id)


class EngineThread:
    """The one thread that runs an LLM's engine for many callers (see the module docstring)."""

    def __init__(self, llm, max_queue: int = 64) -> None:
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
            raise DecodertError(f"max_queue must be an integer >= 0, got {max_queue!r} (--max-queue)")
        self.llm = llm
        self.slots = int(llm.backend.max_batch)
        self.max_queue = max_queue
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._inbox: list[_Request] = []  # submitted, not yet seen by the run
        self._cancels: set[int] = set()  # ids to cancel at the next turn
        self._pending: set[int] = set()  # submitted and not yet given their last event
        self._ids = itertools.count()
        self._closed = False  # no new requests
        self._stopping = False  # the thread ends once the inbox is empty
        self._thread: threading.Thread | None = None
        # engine thread only:
        self._reqs: dict[int, _Request] = {}  # requests in the run without their last event yet, by id
        self._by_handle: dict[int, _Request] = {}  # the same, by engine handle id
        self._rows_since_turn = 0

    # -- any thread ------------------------------------------------------------------------------
    def start(self) -> "EngineThread":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="decodert-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (queued or in a slot)."""
        return len(self._pending)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return max(0, len(self._pending) - self.llm.slots_in_use)

    def sequence(self, prepared: Prepared) -> Sequence:
        """A validated Sequence for a prepared request (``LLM.prepare``); DecodertError as ``Engine.sequence``."""
        return self.llm.engine.sequence(prepared)

    def speculation(self, value: Any) -> SpeculativeConfig | None:
        """A ``speculative=`` value ("ngram" | "draft" | None) checked against this LLM (DecodertError:
        unknown method, no verify graph, no draft model)."""
        return self.llm.engine.speculation(value)

    def submit(self, seq: Sequence, sink: Sink) -> Handle:
        """Queue a request; its events go to ``sink``. QueueFull / EngineClosed when it cannot be taken."""
        with self._cond:
            if self._closed or self._thread is None:
                raise EngineClosed("the server is shutting down" if self._closed else "the engine is not started")
            if len(self._pending) >= self.slots + self.max_queue:
                raise QueueFull(f"all {self.slots} slots are busy and {self.max_queue} requests are waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            rid = next(self._ids)
            self._inbox.append(_Request(rid, seq, sink))
            self._pending.add(rid)
            self._cond.notify_all()
        return Handle(self, rid)

    def cancel(self, rid: int) -> None:
        """Finish request ``rid`` ("cancelled") before the next step; a finished one is left alone."""
        with self._cond:
            if rid in self._pending:
                self._cancels.add(rid)
                self._cond.notify_all()

    def stop(self, drain_s: float = 0.0, join_s: float | None = 30.0) -> None:
        """Refuse new requests, wait up to ``drain_s`` seconds for those in flight, cancel the rest, end the thread."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._pending, timeout=max(0.0, drain_s))
            self._cancels.update(self._pending)
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    # -- the engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._inbox or self._stopping)
                if not self._inbox:
                    return
            self._busy_period()

    def _busy_period(self) -> None:
        """One run of the engine: from the first submitted request until nothing is left."""
        try:
            for handle, delta in self.llm.runs.stream(lambda: (), admit=self._admit):
                self._rows_since_turn += 1
                req = self._by_handle[handle.id]
                if req.seq.done:
                    self._finish(req, Event(delta, result=req.seq.result(), logprobs=self._new_logprobs(req)))
                elif delta:
                    self._send(req, Event(delta, logprobs=self._new_logprobs(req)))
        except Exception as e:  # a failed step ends every request of the run with its reason
            failed = list(self._reqs.values())
            if not failed:  # the run failed before it took any request: the inbox's would be retried forever
                with self._cond:
                    failed, self._inbox = self._inbox, []
            for req in failed:
                self._fail(req, e)
        finally:
            self._count_step()
            self._reqs.clear()
            self._by_handle.clear()

    @staticmethod
    def _new_logprobs(req: _Request) -> tuple:
        entries = req.seq.logprobs
        if not entries:
            return ()
        new, req.logprobs_sent = tuple(entries[req.logprobs_sent:]), len(entries)
        return new

    def _admit(self) -> None:
        """The run's hook, once per step: new requests into the engine, cancelled ones finished."""
        self._count_step()
        engine = self.llm.engine
        with self._cond:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        for req in new:
            self._reqs[req.id] = req
            try:
                req.handle = engine.add(req.seq)
            except Exception as e:  # e.g. the shared cache cannot be allocated: this request fails, never retried
                self._fail(req, e)
                continue
            self._by_handle[req.handle.id] = req
        for rid in cancels:
            req = self._reqs.get(rid)
            if req is not None and not req.seq.done:
                engine.abort(req.handle, CANCELLED)  # type: ignore[arg-type]
                self.stats.cancelled += 1
                self._finish(req, Event(result=req.seq.result()))

    def _fail(self, req: _Request, e: Exception) -> None:
        """End ``req`` with the one-line reason of ``e`` (a server answers 500 generation_failed)."""
        self.stats.failed += 1
        self._finish(req, Event(error=f"generation failed: {type(e).__name__}: {first_line(e)}"))

    def _count_step(self) -> None:
        rows, self._rows_since_turn = self._rows_since_turn, 0
        if rows:
            self.stats.steps += 1
            self.stats.rows += rows
            self.stats.max_rows = max(self.stats.max_rows, rows)

    def _send(self, req: _Request, event: Event) -> None:
        try:
            req.sink(event)
        except Exception:  # the receiver is gone (its event loop closed): nobody reads this request
            if not event.last:
                self.cancel(req.id)

    def _finish(self, req: _Request, event: Event) -> None:
        self._reqs.pop(req.id, None)
        if req.handle is not None:
            self._by_handle.pop(req.handle.id, None)
        self.stats.finished += 1
        self._send(req, event)
        with self._cond:
            self._pending.discard(req.id)
            self._cond.notify_all()
