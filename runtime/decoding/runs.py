"""One cache, one run at a time: how an LLM's generations share its KV cache across calls and threads.

``CacheRuns`` is the part of ``LLM`` (runtime/llm.py) that starts a run over the one cache, waits while another
thread's open stream holds it (``busy_timeout``), ends an abandoned stream of the same thread, and frees the
slots when a run finishes, is closed early or is interrupted.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Generator

from decodert.errors import DecodertError
from decodert.runtime.decoding import scheduler
from decodert.runtime.decoding.generate import GenerationResult, Sequence


class CacheRuns:
    """The run state of an LLM: which run holds the cache, whose thread started it, and the lock."""

    backend: Any
    prefix_cache: Any

    def __init__(self) -> None:
        self._cache: Any = None
        self._live: Generator | None = None  # the run holding the cache; a newer run of the same thread ends it
        self._live_thread: threading.Thread | None = None  # the thread that started it
        self._active: list[int] = []  # the scheduler's slot table (request index per busy slot)
        self._lock = threading.RLock()  # one run touches the cache at a time
        self._free = threading.Condition(self._lock)  # notified when the live run ends
        self.busy_timeout: float | None = None  # seconds to wait for another thread's stream (None: as long as it takes)

    def _end_live(self) -> None:
        """Close the unfinished run (its slots are freed) and wake threads waiting for the cache."""
        if self._live is not None:
            self._live.close()
            self._live = None
            self._free.notify_all()

    def _run(self, seqs: list[Sequence], admit: Any = None,
             runner: Generator | None = None) -> Generator[tuple[int, str], None, None]:
        """Start a run over the one cache (lock held): wait while another thread's stream holds it;
        an unfinished run of this thread (an abandoned stream) is ended. ``admit``: see scheduler.run.
        ``runner``: a run of its own (a session's turn) instead of the scheduler over the shared cache."""
        me = threading.current_thread()
        if not self._wait_free(me):
            raise DecodertError(f"this LLM is busy: a stream of another thread is still open after "
                                f"{self.busy_timeout} s (busy_timeout); finish or close it, or use one LLM per thread")
        self._end_live()
        if runner is None:
            if self._cache is None:
                self._cache = self.backend.allocate(int(self.backend.max_batch))
            runner = scheduler.run(self.backend, self._cache, seqs, self._active, admit, self.prefix_cache)
        self._live = runner
        self._live_thread = me
        return self._live

    def _wait_free(self, me: threading.Thread) -> bool:
        """Wait (lock held) until no other thread's run holds the cache; the run of a thread that has
        exited (a stream it left open) counts as free. False after ``busy_timeout`` seconds."""
        end = None if self.busy_timeout is None else time.monotonic() + self.busy_timeout
        while not (self._live is None or self._live_thread is me
                   or (self._live_thread is not None and not self._live_thread.is_alive())):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._free.wait(0.05 if left is None else min(0.05, left))  # polls: a dead thread notifies nobody
        return True

    def _finish(self, seqs: list[Sequence], runner: Generator | None = None) -> list[GenerationResult]:
        with self._lock:
            run = self._run(seqs, runner=runner)
            try:
                for _ in run:
                    pass
            finally:
                if self._live is run:
                    self._end_live()
        return [s.result() for s in seqs]

    def _stream(self, seqs: list[Sequence], admit: Any = None,
                runner: Generator | None = None) -> Generator[tuple[int, str], None, None]:
        """The run's events, one locked step at a time; the run holds the cache until it ends."""
        with self._lock:
            run = self._run(seqs, admit, runner)
        try:
            while True:
                with self._lock:
                    if self._live is not run:  # a newer run of this thread, or close(), ended it
                        return
                    item = next(run, None)
                if item is None:
                    return
                yield item
        finally:
            with self._lock:
                if self._live is run:  # done, closed early (stream.close(), Ctrl-C) or garbage: free the slots
                    self._end_live()
