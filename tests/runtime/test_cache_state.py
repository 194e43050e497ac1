"""What a cache row holds, model-checked: random interleavings of everything that writes cache rows.

The fake backend (tests/helpers/fake_backend.py) stores the token ids themselves as its "K/V", so after
every operation the state can be checked against the rule of runtime/backends/kv_cache.py:

- every row of the shared cache, of each session and of the draft model holds K/V equal to the
  ids its cache says it holds (``held``), and no row of the shared cache is left in use;
- every prefix-cache entry's K/V equals its ids;
- every greedy answer equals the fake model run from scratch on its prompt (a row that kept a
  rejected draft, a session turn continued on a reset row or a prefix entry under the wrong ids
  changes the tokens).

Operations: generate (one prompt or a batch), streams closed after k deltas, generate_many with
mixed requests (stop strings, plain, ngram, draft), sessions' turns and streamed turns with reset,
undo or close at any point (mid-stream too), speculation by prompt lookup and by a draft model,
eos inside accepted drafts, max_new_tokens and the context's end landing inside a verify pass, a
prefix cache of a few blocks, requests through the server's engine thread cancelled mid-run, and
Ctrl-C inside a graph run (after its in-place writes, before its commit) of a turn or a request.
The same runs again with a hybrid fake (``states=True``: every row also keeps a recurrent state,
tests/helpers/fake_backend.py): every row's state is the one of the ids it holds, every prefix entry's
state the one of its chain's ids, so a prefix hit resumes a linear layer exactly.
``-m slow`` runs many more examples.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fake_backend import FakeBackend, fake_manifest, make_tokenizer, mix_state, reference_tokens  # noqa: E402

from decodert.runtime.engine.thread import CANCELLED, EngineThread as Engine, Event  # noqa: E402
from decodert.runtime.llm import LLM  # noqa: E402
from decodert.runtime.prefix_cache import PrefixCache  # noqa: E402
from decodert.runtime.speculation.speculative import SpeculativeConfig  # noqa: E402

TOK = make_tokenizer()
V = TOK.get_vocab_size()
EOS = TOK.encode("the").ids[0]  # a token the prompts contain: copied into drafts, so eos lands inside accepted runs
MAX_SEQ = 64
CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
QUESTIONS = ["the quick brown fox", "hello world, the end", "jumps over the lazy dog", "the test corpus"]


def target_rule(h: np.ndarray) -> int:
    """Mostly copies the token 5 back (prompt lookup and the draft model are often right), sometimes not."""
    t = len(h)
    if t >= 6 and (int(h[-1]) * 31 + t) % 5:
        return int(h[-5])
    return int((int(h.sum()) * 7919 + t) % V)


def draft_rule(h: np.ndarray) -> int:
    return int(h[-5]) if len(h) >= 5 else int(h[-1])


def make_world(seed: int, states: bool = False) -> tuple[LLM, list[np.ndarray]]:
    target = FakeBackend(vocab_size=V, max_seq=MAX_SEQ, max_batch=3, rule=target_rule, states=states)
    draft = FakeBackend(vocab_size=V, max_seq=MAX_SEQ, max_batch=3, rule=draft_rule, states=states)
    manifest = fake_manifest(target, eos=[EOS], chat_template=CHATML)
    llm = LLM(target, TOK, manifest, draft=LLM(draft, TOK, manifest, prefix_cache_mb=0), prefix_cache_mb=0)
    # six blocks (a hybrid: their states too, 16 bytes each, and a state every 8 tokens on the way)
    llm.prefix_cache = PrefixCache(target, budget_bytes=6 * target.kv_bytes(4) + (48 if states else 0), block_tokens=4,
                                   state_every=8)
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, V, 9)
    prompts = []
    for n in (5, 12, 20, 40, 55):
        p = np.r_[shared, rng.integers(3, V, n)][:n] if n > 9 else rng.integers(3, V, n)
        p[rng.integers(0, n, 2)] = EOS
        prompts.append(p.astype(np.int64))
    return llm, prompts


SPEC = [None, "ngram", "draft", SpeculativeConfig(draft_len=6, adaptive=False)]
spec_st = st.sampled_from(range(len(SPEC)))
new_st = st.integers(1, 40)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("generate"), st.integers(0, 4), new_st, spec_st),
    st.tuples(st.just("batch"), st.lists(st.integers(0, 4), min_size=2, max_size=3), new_st, spec_st),
    st.tuples(st.just("stream"), st.integers(0, 4), new_st, spec_st, st.integers(0, 6)),
    st.tuples(st.just("many"), st.lists(st.tuples(st.integers(0, 4), new_st, spec_st, st.booleans()), min_size=1, max_size=5)),
    st.tuples(st.just("turn"), st.integers(0, 1), st.integers(0, 3), new_st, spec_st),
    st.tuples(st.just("stream_turn"), st.integers(0, 1), st.integers(0, 3), new_st, spec_st, st.integers(0, 6),
              st.sampled_from(["finish", "close_stream", "reset", "undo", "close"])),
    st.tuples(st.sampled_from(["reset", "undo", "close"]), st.integers(0, 1)),
    st.tuples(st.just("interrupted_turn"), st.integers(0, 1), st.integers(0, 3), new_st, spec_st, st.integers(1, 6)),
    st.tuples(st.just("interrupted_generate"), st.integers(0, 4), new_st, spec_st, st.integers(1, 6)),
    st.tuples(st.just("engine"), st.lists(st.tuples(st.integers(0, 4), new_st, spec_st, st.integers(-1, 8)),
                                          min_size=1, max_size=5)),
), min_size=1, max_size=8)


class World:
    """The LLM, its sessions and the checks of every operation."""

    def __init__(self, seed: int, states: bool = False) -> None:
        self.llm, self.prompts = make_world(seed, states)
        self.sessions = [self.llm.session(), self.llm.session(system="Be brief.")]

    def expect(self, ids: np.ndarray, n: int) -> list[int]:
        return reference_tokens(self.llm.backend, ids, min(n, MAX_SEQ - len(ids)), stop_ids=[EOS])

    def run(self, op: tuple) -> None:
        getattr(self, "op_" + op[0])(*op[1:])
        self.check()

    # -- operations ------------------------------------------------------------------------
    def op_generate(self, i: int, n: int, spec: int) -> None:
        r = self.llm.generate(self.prompts[i], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        assert r.token_ids == self.expect(self.prompts[i], n)

    def op_batch(self, idx: list[int], n: int, spec: int) -> None:
        rs = self.llm.generate([self.prompts[i] for i in idx], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        assert [r.token_ids for r in rs] == [self.expect(self.prompts[i], n) for i in idx]

    def op_stream(self, i: int, n: int, spec: int, take: int) -> None:
        s = self.llm.stream(self.prompts[i], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        for _ in zip(range(take), s):
            pass
        s.close()

    def op_many(self, reqs: list[tuple[int, int, int, bool]]) -> None:
        rs = self.llm.generate_many([{"prompt": self.prompts[i], "max_new_tokens": n, "temperature": 0,
                                      "speculative": SPEC[spec], **({"stop": [" the"]} if stop else {})}
                                     for i, n, spec, stop in reqs])
        for r, (i, n, _, stop) in zip(rs, reqs):
            want = self.expect(self.prompts[i], n)
            assert r.token_ids == (want[: len(r.token_ids)] if stop else want)

    def op_engine(self, reqs: list[tuple[int, int, int, int]]) -> None:
        """Requests through the server's engine thread; request j is cancelled after ``cancel_at`` of its
        deltas (-1: never). The engine's run ends when the last one finishes; then the state is checked."""
        engine = Engine(self.llm, max_queue=16).start()
        done = threading.Event()
        results: dict[int, Any] = {}
        handles: dict[int, Any] = {}
        counts = [0] * len(reqs)

        def sink_for(j: int) -> Any:
            def sink(event: Event) -> None:
                counts[j] += 1
                if event.last:
                    results[j] = event.result
                    if len(results) == len(reqs):
                        done.set()
                elif counts[j] == reqs[j][3] and j in handles:
                    handles[j].cancel()  # on the engine thread, between steps: applied before the next one
            return sink

        try:
            for j, (i, n, spec, _) in enumerate(reqs):
                seq = engine.sequence(engine.llm.prepare(self.prompts[i], max_new_tokens=n, temperature=0,
                                                         speculative=engine.speculation(SPEC[spec])))
                handles[j] = engine.submit(seq, sink_for(j))
            assert done.wait(30), "the engine did not finish its requests"
        finally:
            engine.stop(join_s=30)
        for j, (i, n, _, _) in enumerate(reqs):
            want = self.expect(self.prompts[i], n)
            r = results[j]
            assert r.token_ids == (want[: len(r.token_ids)] if r.finish_reason == CANCELLED else want)

    def op_turn(self, k: int, q: int, n: int, spec: int) -> None:
        s = self.sessions[k]
        r = s.chat(QUESTIONS[q], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        assert r.token_ids == self.expect(self.llm.prepare(s.history[:-1], chat=True).ids, n)

    def op_stream_turn(self, k: int, q: int, n: int, spec: int, take: int, then: str) -> None:
        s = self.sessions[k]
        before = list(s._turns)
        stream = s.stream_chat(QUESTIONS[q], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        for _ in zip(range(take), stream):
            pass
        if then == "finish":
            list(stream)
            assert stream.result.token_ids == self.expect(self.llm.prepare(s.history[:-1], chat=True).ids, n)
            return
        if then == "close_stream":
            stream.close()
            return
        running = s._running is not None  # started and not finished
        if then == "undo" and not running:
            self.op_undo(k)  # nothing in flight: the last finished turn, if there is one
        else:
            getattr(s, then)()
        if not running:  # never started (a stream runs at its first delta) or already over
            list(stream)
            return
        calls = len(self.llm.backend.calls)
        assert list(stream) == [] and len(self.llm.backend.calls) == calls  # cancelled: nothing more runs on the row
        # CANCELLED, or its own reason when the last token came before it was drained: in flight all the same
        assert stream.result.finish_reason in (CANCELLED, "stop", "length")
        assert s._turns == ([] if then == "reset" else before)

    def op_interrupted_turn(self, k: int, q: int, n: int, spec: int, at: int) -> None:
        """A turn whose ``at``-th graph run of the target is interrupted (a reply cut short, or no reply at all)."""
        self.llm.backend.interrupt_in = at
        try:
            self.sessions[k].chat(QUESTIONS[q], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        except KeyboardInterrupt:
            pass
        finally:
            self.llm.backend.interrupt_in = None

    def op_interrupted_generate(self, i: int, n: int, spec: int, at: int) -> None:
        self.llm.backend.interrupt_in = at
        try:
            self.llm.generate(self.prompts[i], max_new_tokens=n, temperature=0, speculative=SPEC[spec])
        except KeyboardInterrupt:
            pass
        finally:
            self.llm.backend.interrupt_in = None

    def op_reset(self, k: int) -> None:
        self.sessions[k].reset()

    def op_undo(self, k: int) -> None:
        if any(m["role"] == "user" for m in self.sessions[k].history):
            self.sessions[k].undo()

    def op_close(self, k: int) -> None:
        self.sessions[k].close()

    # -- the invariant ---------------------------------------------------------------------
    def check(self) -> None:
        llm = self.llm
        assert llm.slots_in_use == 0
        if llm.engine.cache is not None:
            assert not llm.engine.cache.lengths.any(), "a row of the shared cache is left in use"
        for s in self.sessions:
            if s.row is not None:
                _rows_hold_their_ids(s.row.cache)
        draft = llm.speculator._draft
        if draft is not None:
            _rows_hold_their_ids(draft.cache)
        for e in llm.prefix_cache._entries.values():
            assert np.array_equal(e.kv, e.ids), f"prefix entry holds K/V {e.kv.tolist()} under ids {e.ids.tolist()}"
            if e.state is not None:
                chain, p = [], e
                while p is not None:
                    chain, p = [p.ids, *chain], p.parent
                assert np.array_equal(np.frombuffer(e.state[0], np.int64), mix_state(np.concatenate(chain))), \
                    "a prefix entry's state is not the one of its chain's ids"


def _rows_hold_their_ids(cache) -> None:
    for slot in range(cache.slots):
        held = cache.held(slot)
        assert np.array_equal(cache.tokens[slot, : len(held)], held), \
            f"slot {slot}: K/V {cache.tokens[slot, :len(held)].tolist()} but holds ids {held.tolist()}"
        if cache.states:
            assert np.array_equal(cache.states[0][slot], mix_state(held)), f"slot {slot}: its state is not its ids'"


def _run_ops(seed: int, ops: list[tuple], states: bool = False) -> None:
    world = World(seed, states)
    for op in ops:
        world.run(op)
    world.sessions[0].chat(QUESTIONS[0], max_new_tokens=12, temperature=0)  # a last turn after whatever came before
    world.check()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(seed=st.integers(0, 3), ops=ops_st)
def test_cache_rows_hold_what_they_say(seed, ops):
    _run_ops(seed, ops)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), ops=ops_st)
def test_cache_rows_hold_what_they_say_many(seed, ops):
    _run_ops(seed, ops)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(seed=st.integers(0, 3), ops=ops_st)
def test_hybrid_rows_and_prefix_states_hold_what_they_say(seed, ops):
    """The same runs over a hybrid: states beside K/V, the prefix cache storing and loading them."""
    _run_ops(seed, ops, states=True)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), ops=ops_st)
def test_hybrid_rows_and_prefix_states_hold_what_they_say_many(seed, ops):
    _run_ops(seed, ops, states=True)


# -- the defects found by review, each as its own repro ---------------------------------------------
def test_finished_speculative_row_stores_only_what_it_holds():
    """A row that finishes inside a verify pass (eos where the draft said otherwise) used to keep its
    rejected drafts' K/V past its length, and the prefix cache stored them under the history's ids."""
    world = World(0)
    for n in (3, 9, 17, 30):
        for i in range(5):
            world.run(("many", [(i, n, 3, False), ((i + 1) % 5, n, 1, True)]))
    assert world.llm.prefix_cache._entries


def test_session_reset_mid_stream_cancels_the_turn():
    world = World(1)
    s = world.sessions[0]
    s.chat(QUESTIONS[0], max_new_tokens=8, temperature=0)
    it = iter(s.stream_chat(QUESTIONS[1], max_new_tokens=40, temperature=0))
    [next(it) for _ in range(3)]
    s.reset()
    assert list(it) == [] and s.history == [] and s.cached_tokens == 0
    assert it.result.finish_reason == CANCELLED
    r = s.chat(QUESTIONS[2], max_new_tokens=12, temperature=0)
    assert r.token_ids == world.expect(world.llm.prepare(s.history[:-1], chat=True).ids, 12)


def test_session_undo_mid_stream_returns_the_cancelled_turn():
    world = World(2)
    s = world.sessions[1]
    s.chat(QUESTIONS[0], max_new_tokens=8, temperature=0)
    before = s.history
    stream = s.stream_chat(QUESTIONS[1], max_new_tokens=40, temperature=0)
    shown = "".join(d for _, d in zip(range(4), stream))
    removed = s.undo()
    assert removed == [{"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": shown}]
    assert list(stream) == [] and s.history == before
    world.run(("turn", 1, 3, 10, 1))


def test_session_close_mid_stream_ends_it_without_touching_the_freed_row():
    world = World(3)
    s = world.sessions[0]
    stream = s.stream_chat(QUESTIONS[0], max_new_tokens=40, temperature=0)
    next(iter(stream))
    calls = len(world.llm.backend.calls)
    s.close()
    assert list(stream) == [] and len(world.llm.backend.calls) == calls and s.history == []
    world.run(("turn", 0, 1, 10, 2))


def test_one_draft_model_cache_for_concurrent_first_requests():
    """Two threads asking for the draft drafter at once get the same one (one draft cache allocated)."""
    world = World(0)
    backend = world.llm.draft.backend
    allocated, real = [], backend.allocate

    def slow_allocate(slots):
        time.sleep(0.05)
        allocated.append(slots)
        return real(slots)

    backend.allocate = slow_allocate
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(world.llm.speculator.drafter(SpeculativeConfig("draft"))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(allocated) == 1 and len({id(d) for d in got}) == 1
