"""One engine, many callers: how the runs of an LLM's callers take turns on its engine.

A *run* is a caller's requests from their ``add`` to their end (a ``generate`` call, an open stream, a
session's turn, a server's busy period). Runs take the engine one at a time:
- a run of another thread that is still open (a stream being read) makes a new run wait, at most
  ``busy_timeout`` seconds (then DecodertError; default: no limit); a stream left open by a thread that has
  exited no longer counts (the next run ends it);
- a new run of the same thread ends that thread's unfinished run (an abandoned stream): its requests are
  dropped and their slots freed;
- however a run ends (done, closed early, an exception such as KeyboardInterrupt from a step), its
  unfinished requests are dropped and every slot it used is free before the next run starts.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generator, Iterable

from decodert.errors import DecodertError
from decodert.runtime.engine.engine import Engine
from decodert.runtime.engine.request import Handle

Events = Generator[tuple[Handle, str], None, None]


class Runs:
    """The engine's one-run-at-a-time gate (see the module docstring). ``lock`` is held while a step runs:
    hold it to change what the engine's rows hold between steps (a session's undo, an adapter reload)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = threading.RLock()  # one run touches the engine at a time
        self._free = threading.Condition(self.lock)  # notified when the live run ends
        self._live: Events | None = None  # the run holding the engine
        self._live_thread: threading.Thread | None = None  # the thread that started it
        self.busy_timeout: float | None = None  # seconds to wait for another thread's stream (None: no limit)

    @property
    def busy(self) -> bool:
        """A run holds the engine."""
        return self._live is not None

    def end(self) -> None:
        """End the live run, if any (its unfinished requests are dropped), and wake waiting threads."""
        with self.lock:
            if self._live is not None:
                self._live.close()
                self._live = None
                self._free.notify_all()

    def finish(self, add: Callable[[], Iterable[Handle]]) -> None:
        """Start a run (``add()`` queues its requests once the engine is this thread's) and step it to its end."""
        with self.lock:
            run = self._start(add, None)
            try:
                for _ in run:
                    pass
            finally:
                if self._live is run:
                    self.end()

    def stream(self, add: Callable[[], Iterable[Handle]], admit: Callable[[], None] | None = None) -> Events:
        """Start a run -> its events ``(handle, text delta)``, one locked step at a time; the run holds the
        engine until it ends. ``admit``: called before every step, it may add and abort requests (a server's
        inbox); the run then lasts until the engine is idle, not just until the first requests are done.
        Nothing starts before the first ``next``: a stream closed before it was read never held the engine."""
        with self.lock:
            run = self._start(add, admit)
        try:
            while True:
                with self.lock:
                    if self._live is not run:  # a newer run of this thread, or close(), ended it
                        return
                    item = next(run, None)
                if item is None:
                    return
                yield item
        finally:
            with self.lock:
                if self._live is run:  # done, closed early (stream.close(), Ctrl-C) or garbage: free the slots
                    self.end()

    def _start(self, add: Callable[[], Iterable[Handle]], admit: Callable[[], None] | None) -> Events:
        me = threading.current_thread()
        if not self._wait_free(me):
            raise DecodertError(f"this LLM is busy: a stream of another thread is still open after "
                                f"{self.busy_timeout} s (busy_timeout); finish or close it, or use one LLM per thread")
        self.end()
        self._live, self._live_thread = self._steps(list(add()), admit), me
        return self._live

    def _steps(self, handles: list[Handle], admit: Callable[[], None] | None) -> Events:
        engine = self.engine
        engine.open = admit is not None  # a run open to new requests never drains its speculation
        try:
            while True:
                if admit is not None:
                    admit()
                elif all(h.done for h in handles):
                    return
                events = engine.step()
                if not events and engine.idle:
                    return
                yield from events
        finally:
            for h in handles:
                if not h.done:
                    engine.abort(h)
            if admit is not None:  # a server's run: nobody else's requests are in the engine
                for h in list(engine.unfinished()):
                    engine.abort(h)
            engine.settle()

    def _wait_free(self, me: threading.Thread) -> bool:
        """Wait (lock held) until no other thread's run holds the engine; the run of a thread that has exited
        (a stream it left open) counts as free. False after ``busy_timeout`` seconds."""
        end = None if self.busy_timeout is None else time.monotonic() + self.busy_timeout
        while not (self._live is None or self._live_thread is me
                   or (self._live_thread is not None and not self._live_thread.is_alive())):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._free.wait(0.05 if left is None else min(0.05, left))  # polls: a dead thread notifies nobody
        return True
