"""Chat sessions: a conversation bound to its own cache row, so a turn prefills only what is new.

    session = llm.session(system="Be brief.")            # overflow="truncate" (default) | "error"
    session.chat("Hi").text                              # a GenerationResult
    for delta in session.stream_chat("And then?"): ...   # text deltas (a TextStream)
    session.history; session.undo(); session.reset(); session.close()
    session.save("chat.session"); session = llm.resume("chat.session")   # on disk (runtime/chat/saved.py)

Reuse. Each turn renders the whole conversation with the chat template and compares its ids with
the ids whose K/V the row holds. The row is rewound to their longest common prefix and only the
rest is prefilled: templates may render earlier turns differently once a turn is added (and a
reply's text need not re-tokenize to the ids that were generated), so nothing is assumed. An
empty row (first turn, after ``reset``) starts from the LLM's prefix cache when it has the prompt's
beginning (a shared system prompt); the first turn's prompt blocks are stored there, later turns
are not (they would fill it with one conversation).

Overflow. A turn needs its prompt plus room for the answer: ``min(max_new_tokens, max_seq // 2)``
tokens (max_seq: the context the model was exported with). When that does not fit:
- ``"truncate"``: the oldest turns (a user message and the replies after it; the system message
  stays) are dropped until the conversation fills at most half the context and leaves that room,
  then the row is prefilled again. Dropping down to half means that re-prefill happens once in a
  few turns, not on every turn. ``last_turn.dropped_turns`` says how many were dropped. When the
  system message and the new message alone leave no room for a single token: DecodertError.
- ``"error"``: DecodertError naming the sizes; the session is left as it was.

The answer of a turn that hits the end of the context ends with finish_reason "length";
``last_turn.cut_by`` tells "context" from "max_new_tokens".

State. The session's row is pinned in the LLM's engine (``Engine.pin``, runtime/engine/scheduler.py): a
cache of its own that keeps the conversation between turns, and every turn is a request the engine runs on
it. The row's cache (runtime/backends/kv_cache.py) records which ids its K/V holds; the session keeps no
copy of its own, so the turns and the row cannot disagree. ``reset``, ``undo`` or ``close`` while a
``stream_chat`` is running cancel that turn: the stream ends (its result's finish_reason is
"cancelled"), nothing of it is kept in the history, and the row is not touched by it again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generator, Iterator, Mapping

from decodert.errors import DecodertError
from decodert.runtime.chat import saved
from decodert.runtime.chat.chat import Message, check_messages
from decodert.runtime.chat.turn import ChatStream
from decodert.runtime.decoding.generate import GenerationResult, Sequence, TextStream
from decodert.runtime.engine.request import CANCELLED, Handle, Prepared


OVERFLOW_POLICIES = ("truncate", "error")


@dataclass(frozen=True)
class TurnInfo:
    """What the last turn did with the row."""

    prompt_tokens: int  # the rendered conversation
    reused_tokens: int  # of those, K/V kept from earlier turns or loaded from the prefix cache
    dropped_turns: int  # oldest turns dropped to fit (overflow="truncate")
    cut_by: str | None  # None, "max_new_tokens" or "context": why an answer ended early


class Session:
    """One conversation over an LLM (runtime/llm.py, not imported here: it imports this module);
    see the module docstring. Make it with ``llm.session()``."""

    def __init__(self, llm: Any, system: str | None = None, overflow: str = "truncate") -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise DecodertError(f"unknown overflow policy {overflow!r}; expected one of {', '.join(OVERFLOW_POLICIES)}")
        if system is not None and not isinstance(system, str):
            raise DecodertError(f"system message must be a string, not {type(system).__name__}")
        self.llm, self.overflow = llm, overflow
        self._system = [{"role": "system", "content": system}] if system else []
        self._turns: list[dict] = []  # user / assistant messages after the system message
        self._row: Any = None  # the session's pinned row in the engine (runtime/engine/scheduler.py Row), on the first turn
        self._running: _Running | None = None  # the turn in flight (a stream not finished yet)
        self.last_turn: TurnInfo | None = None
        self.dropping = 0  # oldest turns the turn being started drops: known before its answer (last_turn: after)

    # -- the conversation ------------------------------------------------------------------------
    @property
    def history(self) -> list[dict]:
        """The messages so far (copies), system message first."""
        return [dict(m) for m in self._system + self._turns]

    @property
    def system(self) -> str | None:
        """The system message (None: none)."""
        return self._system[0]["content"] if self._system else None

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V the session's row holds now."""
        return 0 if self._row is None else self._row.length

    @property
    def row(self) -> Any:
        """The session's pinned row (its ``cache`` holds the conversation's K/V), or None before the first turn."""
        return self._row

    def chat(self, message: str | Message, **params: Any) -> GenerationResult:
        """Add a user message (text, or a message dict), generate the reply and keep both.
        ``params``: as ``LLM.chat`` (sampling, json_schema / regex / grammar, speculative)."""
        prepared, seq, turns, dropped = self._begin(message, params)
        for _ in self._turn(seq, turns, dropped):
            pass
        return prepared.turn.finish(seq.result(), prepared.text)

    def stream_chat(self, message: str | Message, **params: Any) -> TextStream:
        """``chat`` as a stream of text deltas; closing it early keeps the part of the reply shown."""
        prepared, seq, turns, dropped = self._begin(message, params)
        stream = TextStream(self._turn(seq, turns, dropped), seq)
        turn = prepared.turn
        return stream if turn.plain else ChatStream(stream, turn.output(prepared.text), turn.tools is not None)

    def undo(self) -> list[dict]:
        """Remove the last turn (the last user message and the replies after it); returns it.
        While a stream runs, its turn is the last one: it is cancelled and returned (the reply so far)."""
        with self._quiet():
            running = self._cancel()
            if running is not None:
                return [dict(running.message), {"role": "assistant", "content": "".join(running.seq.parts)}]
            starts = [i for i, m in enumerate(self._turns) if m.get("role") == "user"]
            if not starts:
                raise DecodertError("nothing to undo: the conversation has no user message yet")
            removed, self._turns = self._turns[starts[-1]:], self._turns[: starts[-1]]
            return removed  # the row is rewound on the next turn (common prefix)

    def reset(self) -> None:
        """Forget every turn (the system message stays); the row is kept, emptied. Cancels a running stream."""
        with self._quiet():
            self._cancel()
            self._turns = []
            if self._row is not None:
                self._row.cache.reset(0)

    def close(self) -> None:
        """Free the session's cache row now (the session stays usable: a later turn allocates again).
        Cancels a running stream."""
        with self._quiet():
            self._cancel()
            row, self._row = self._row, None
            if row is not None and hasattr(row.cache, "free"):
                row.cache.free()

    def save(self, path: str | Path) -> int:
        """Write the conversation, its row's ids, K/V and states, the system message and the overflow policy to
        ``path`` (one checksummed file, written atomically: runtime/chat/saved.py) -> its bytes. ``LLM.resume``
        reads it back. DecodertError while a stream runs (finish or close it first), or when ``path`` cannot be
        written (an earlier file there is kept whole)."""
        with self._quiet():
            if self._running is not None and not self._running.seq.done:
                raise DecodertError("a turn is streaming; finish or close its stream before saving the session")
            return saved.write_session(path, self.llm, self.system, self.overflow, self._turns, self._row)

    @classmethod
    def resume(cls, llm: Any, path: str | Path, convert_kv: bool = False) -> "Session":
        """A session read from a ``save`` file, its row holding what the saved one held (``LLM.resume``)."""
        state = saved.read_session(path, llm, convert_kv)
        session = llm.session(state.system, state.overflow)
        session._turns = state.turns
        if state.kv is not None and len(state.ids):
            row = llm.engine.pin()
            try:
                with session._quiet():
                    state.fill(llm, row.cache)
            except BaseException:
                if hasattr(row.cache, "free"):
                    row.cache.free()
                raise
            session._row = row
        return session

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the engine's run lock: a step of a stream on another thread finishes before the row changes."""
        with self.llm.runs.lock:
            yield

    def _cancel(self) -> "_Running | None":
        """End the turn in flight, if any: its stream stops at its next step and writes nothing back."""
        running, self._running = self._running, None
        if running is not None and running.handle is not None and not running.seq.done:
            self.llm.engine.abort(running.handle, CANCELLED)  # off the row: no step touches it again
        elif running is not None and not running.seq.done:
            running.seq.finish_reason = CANCELLED
        return running

    # -- one turn --------------------------------------------------------------------------------
    def _begin(self, message: str | Message, params: Mapping[str, Any]) -> tuple[Prepared, Sequence, list[dict], int]:
        """Validate, fit the conversation into the context -> (the prepared turn, its sequence, the turns it
        renders, turns dropped)."""
        if isinstance(message, str):
            message = {"role": "user", "content": message}
        msg = check_messages([message])[0]
        turns, prepared, dropped = self._fit(self._turns + [msg], params)
        self.dropping = dropped
        return prepared, self.llm.engine.sequence(prepared), turns, dropped

    def _fit(self, turns: list[dict], params: Mapping[str, Any]) -> tuple[list[dict], Prepared, int]:
        """The turns that fit with room for the answer -> (turns, their prepared request, turns dropped).
        ``params``: the turn's generation and chat options (``LLM.prepare``)."""
        max_seq = self.llm.max_seq
        rendered = self.llm.prepare(self._system + turns, chat=True, **params)
        room = min(rendered.params.max_new_tokens, max_seq // 2)
        ids = rendered.ids
        if len(ids) + room <= max_seq:
            return turns, rendered, 0
        if self.overflow == "error":
            raise DecodertError(f"the conversation needs {len(ids)} tokens plus {room} for the answer but the context "
                                f"holds {max_seq}; session.undo() or reset(), lower max_new_tokens, or use "
                                "overflow='truncate'")
        dropped = 0
        while len(ids) + room > max_seq or len(ids) > max_seq // 2:
            end = _first_turn_end(turns)
            if end is None:
                break
            turns, dropped = turns[end:], dropped + 1
            rendered = self.llm.prepare(self._system + turns, chat=True, **params)
            ids = rendered.ids
        if len(ids) >= max_seq:
            raise DecodertError(f"the message needs {len(ids)} tokens with the system message, but the context holds "
                                f"{max_seq} (--max-seq at export); send a shorter message")
        return turns, rendered, dropped

    def _turn(self, seq: Sequence, turns: list[dict], dropped: int) -> Generator[tuple[int, str], None, None]:
        """Run one turn as a request on the session's pinned row (the engine's prefill rewinds the row to the
        longest common prefix of what it holds and the new prompt, then prefills the rest); keep the turn
        unless it was cancelled."""
        with self._quiet():
            self._cancel()  # a turn left running (an abandoned stream) is over
        me = self._running = _Running(turns[-1], seq)
        if self._row is None:
            self._row = self.llm.engine.pin()
        row = self._row
        row.store_prefix = not self._turns  # only the first turn stores (its system prompt's blocks)

        def add() -> list[Handle]:
            me.handle = self.llm.engine.add(seq, row)
            return [me.handle]

        events = self.llm.runs.stream(add)
        started = finished = False
        try:
            for handle, delta in events:
                started = True
                yield handle.id, delta
            finished = started  # done, or ended by a newer run: a stopped turn keeps the reply shown so far
        except (GeneratorExit, KeyboardInterrupt):
            finished = started
            raise
        finally:
            events.close()
            if finished and self._running is me:  # not cancelled by reset / undo / close
                self._turns = turns + [{"role": "assistant", "content": "".join(seq.parts)}]
                self.last_turn = TurnInfo(len(seq.prompt), seq.cached_tokens, dropped, _cut_by(seq))
            if self._running is me:
                self._running = None


@dataclass
class _Running:
    """The turn in flight: its user message and its sequence."""

    message: dict
    seq: Sequence
    handle: Handle | None = None  # once the engine has it


def _first_turn_end(turns: list[dict]) -> int | None:
    """End (exclusive) of the oldest turn: the next user message after the first one; None when the
    oldest turn is the last (the new message is never dropped)."""
    later = [i for i, m in enumerate(turns) if i > 0 and m.get("role") == "user"]
    return later[0] if later else None


def _cut_by(seq: Sequence) -> str | None:
    if seq.finish_reason != "length":
        return None
    return "max_new_tokens" if len(seq.generated) >= seq.params.max_new_tokens else "context"
