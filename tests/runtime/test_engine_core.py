"""The engine itself (runtime/engine/engine.py, scheduler.py, strategy.py): add / step / abort, pinned rows,
admission, what a failed step leaves, checked over the fake backend against its from-scratch reference."""


import numpy as np
import pytest

from fake_backend import make_llm, reference_tokens  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.engine.request import CANCELLED  # noqa: E402
from decodert.runtime.engine.scheduler import Scheduler  # noqa: E402
from decodert.runtime.engine.strategy import PLAIN, SPECULATIVE, strategy_for  # noqa: E402
from decodert.runtime.prefix_cache import PrefixCache  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox jumps", "a", "lazy dog", "STOP here.", "héllo wörld"]


def _seq(llm, prompt, n, **params):
    return llm.engine.sequence(llm.prepare(prompt, max_new_tokens=n, temperature=0, **params))


def _drive(engine, handles, limit=1000):
    """Step until every handle is done -> the events per handle id, and the number of steps."""
    events, steps = {h.id: [] for h in handles}, 0
    while not all(h.done for h in handles):
        out = engine.step()
        assert out, "the engine stopped before its requests were done"
        steps += 1
        assert steps < limit
        for h, delta in out:
            events.setdefault(h.id, []).append(delta)
    engine.settle()
    return events, steps


def test_add_step_equals_the_reference_and_frees_every_slot():
    llm = make_llm(max_batch=3, max_seq=64)
    engine = llm.engine
    seqs = [_seq(llm, p, n) for p, n in zip(PROMPTS, (5, 9, 3, 7, 4, 6))]
    handles = [engine.add(s) for s in seqs]
    assert engine.waiting == 6 and engine.slots_in_use == 0  # nothing runs before a step
    events, steps = _drive(engine, handles)
    for s in seqs:
        assert s.generated.tolist() == reference_tokens(llm.backend, s.prompt.tolist(), s.params.max_new_tokens)
    for h in handles:  # one event per generated token, the text they add up to is the result's
        assert len(events[h.id]) == len(h.seq.generated) and "".join(events[h.id]) == h.seq.result().text
    assert engine.slots_in_use == 0 and engine.idle and not engine.cache.lengths.any()
    assert steps < sum(s.params.max_new_tokens for s in seqs)  # rows shared decode steps


def test_abort_without_reason_drops_the_row_and_keeps_nothing():
    llm = make_llm(max_batch=2, max_seq=64)
    llm.prefix_cache = PrefixCache(llm.backend, 1 << 20, block_tokens=2)
    engine = llm.engine
    a, b = engine.add(_seq(llm, PROMPTS[1], 20)), engine.add(_seq(llm, PROMPTS[0], 20))
    engine.step()  # both admitted and prefilled
    stored = len(llm.prefix_cache._entries)
    engine.abort(a)
    assert not a.done and engine.slots_in_use == 1 and len(llm.prefix_cache._entries) == stored
    assert int(engine.cache.lengths[1]) == 0  # b moved into slot 0, slot 1 is free and empty
    _drive(engine, [b])
    assert b.seq.generated.tolist() == reference_tokens(llm.backend, b.seq.prompt.tolist(), 20)


def test_abort_with_a_reason_finishes_it_and_stores_what_it_holds():
    llm = make_llm(max_batch=2, max_seq=64)
    llm.prefix_cache = PrefixCache(llm.backend, 1 << 20, block_tokens=2)
    engine = llm.engine
    a = engine.add(_seq(llm, PROMPTS[1], 20))
    engine.step()
    engine.step()
    before = len(llm.prefix_cache._entries)
    engine.abort(a, CANCELLED)
    assert a.done and a.seq.finish_reason == CANCELLED and engine.slots_in_use == 0
    assert len(llm.prefix_cache._entries) > before  # its generated blocks were kept, as a finished row's are


def test_abort_of_a_waiting_request_never_prefills_it():
    llm = make_llm(max_batch=1, max_seq=64)
    engine = llm.engine
    a, b = engine.add(_seq(llm, PROMPTS[0], 3)), engine.add(_seq(llm, PROMPTS[1], 3))
    engine.abort(b)
    _drive(engine, [a])
    assert engine.step() == [] and len(b.seq.generated) == 0 and b.seq.cached_tokens == 0


def test_a_pinned_row_keeps_its_tokens_and_never_takes_a_shared_slot():
    llm = make_llm(max_batch=1, max_seq=64)
    engine = llm.engine
    row = engine.pin()
    shared = [engine.add(_seq(llm, p, 6)) for p in PROMPTS[:2]]
    pinned = engine.add(_seq(llm, PROMPTS[2], 8), row)
    seen_rows = set()
    while not all(h.done for h in shared + [pinned]):
        for h, _ in engine.step():
            seen_rows.add(h.row is not None)
        assert engine.slots_in_use <= 1
    assert seen_rows == {True, False}
    for h in shared + [pinned]:
        assert h.seq.generated.tolist() == reference_tokens(llm.backend, h.seq.prompt.tolist(), h.seq.params.max_new_tokens)
    assert row.length == len(pinned.seq.prompt) + 8 - 1  # the row keeps its conversation (the last token is not cached)
    busy = engine.add(_seq(llm, PROMPTS[3], 4), row)
    with pytest.raises(DecodertError, match="already runs"):  # one request at a time on a row
        engine.add(_seq(llm, PROMPTS[3], 4), row)
    engine.abort(busy)
    engine.settle()  # the finished shared rows leave their slot
    assert engine.idle


def test_a_failed_step_drops_every_request_and_the_engine_goes_on():
    llm = make_llm(max_batch=2, max_seq=64)
    engine = llm.engine
    handles = [engine.add(_seq(llm, p, 10)) for p in PROMPTS[:3]]
    engine.step()
    decode = llm.backend.decode

    def broken(*a, **k):
        raise RuntimeError("device lost")

    llm.backend.decode = broken
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.idle and engine.slots_in_use == 0 and not engine.cache.lengths.any()
    assert not any(h.done for h in handles)
    llm.backend.decode = decode
    again = engine.add(_seq(llm, PROMPTS[1], 5))
    _drive(engine, [again])
    assert again.seq.generated.tolist() == reference_tokens(llm.backend, again.seq.prompt.tolist(), 5)


def test_the_strategy_is_speculative_only_when_a_row_speculates():
    llm = make_llm(max_batch=2, max_seq=64)
    plain, spec = _seq(llm, PROMPTS[0], 4), _seq(llm, PROMPTS[1], 4, speculative="ngram")
    assert strategy_for([plain]) is PLAIN and strategy_for([plain, spec]) is SPECULATIVE


def test_scheduler_admits_into_free_slots_and_vacates_by_moving_the_last():
    llm = make_llm(max_batch=2, max_seq=64)
    scheduler = Scheduler(2)
    handles = []
    for p in PROMPTS[:3]:
        handles.append(llm.engine.add(_seq(llm, p, 3)))  # handles only; this scheduler is not the engine's
        scheduler.queue(handles[-1])
    work = scheduler.next(has_state=False)
    assert work.kind == "admit" and work.handles == handles[:2] and work.slots == [0, 1] and work.groups == [[0, 1]]
    assert scheduler.next(has_state=False).kind == "decode"  # the third waits for a slot
    assert scheduler.vacate(0) == 1 and scheduler.running == [handles[1]]
    work = scheduler.next(has_state=False)
    assert work.kind == "admit" and work.handles == [handles[2]] and work.slots == [1]
    assert np.array_equal([h.id for h in scheduler.running], [handles[1].id, handles[2].id])
