"""The engine thread (runtime/engine/thread.py): requests from many threads join one continuous batch between steps."""

import threading

import pytest

from fake_backend import FakeBackend, make_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.engine.thread import CANCELLED, EngineThread as Engine, EngineClosed, QueueFull  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox jumps", "a", "héllo wörld: accents", "lazy dog", "STOP here."]


class Collect:
    """A sink: text deltas and the last event; ``wait()`` until the request ended."""

    def __init__(self, on_text=None) -> None:
        self.texts, self.last, self.done = [], None, threading.Event()
        self.on_text = on_text

    def __call__(self, event) -> None:
        if event.text:
            self.texts.append(event.text)
            if self.on_text:
                self.on_text(self)
        if event.last:
            self.last = event
            self.done.set()

    def wait(self, timeout: float = 20.0):
        assert self.done.wait(timeout), "the request never ended"
        return self.last


class GatedBackend(FakeBackend):
    """A FakeBackend whose decode steps wait for ``gate`` (set it to let the engine run)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.fail_next = False

    def decode(self, cache, slots, ids, want_logits):
        assert self.gate.wait(20), "test gate never opened"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost\nsecond line")
        return super().decode(cache, slots, ids, want_logits)


def _engine(max_batch=2, max_queue=8, gated=False, **kw):
    llm = make_llm(max_batch=max_batch, max_seq=64, **kw)
    if gated:
        llm.backend = GatedBackend(vocab_size=llm.backend.vocab_size, max_seq=64, max_batch=max_batch)
    return Engine(llm, max_queue=max_queue).start()


def _submit(engine, prompt, n, sink=None, **params):
    seq = engine.sequence(engine.llm.prepare(prompt, max_new_tokens=n, **params))
    sink = sink or Collect()
    return engine.submit(seq, sink), sink


def test_requests_from_threads_match_offline_and_share_steps():
    engine = _engine(max_batch=3, gated=True)
    lengths = [5, 9, 3, 7, 4, 8]
    engine.llm.backend.gate.set()
    offline = [engine.llm.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    engine.llm.backend.gate.clear()  # the clients' requests all arrive before the first decode step
    sinks = [None] * len(PROMPTS)

    def client(i):
        sinks[i] = _submit(engine, PROMPTS[i], lengths[i])[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.llm.backend.gate.set()
    for sink, ref in zip(sinks, offline):
        last = sink.wait()
        assert last.result.token_ids == ref.token_ids and "".join(sink.texts) == ref.text == last.result.text
    stats = engine.stats
    assert stats.finished == 6 and stats.max_rows >= 2 and stats.max_rows <= 3
    assert stats.rows == sum(lengths) and stats.steps < sum(lengths)  # one at a time would take one step per token
    engine.stop()


def test_new_request_joins_between_decode_steps():
    engine = _engine(max_batch=2)
    late = Collect()
    first = Collect(on_text=lambda s: len(s.texts) == 2 and _submit(engine, "lazy dog", 4, late))
    _submit(engine, "hello world", 8, first)
    first.wait(), late.wait()
    calls = [(kind, slots) for kind, slots, _ in engine.llm.backend.calls]
    # prefill A, decode A, then B is prefilled into slot 1 while A is unfinished, then both decode together
    assert calls[:4] == [("prefill", (0,)), ("decode", (0,)), ("prefill", (1,)), ("decode", (0, 1))]
    assert late.last.result.token_ids == engine.llm.generate("lazy dog", max_new_tokens=4).token_ids
    engine.stop()


def test_cancel_frees_the_slot_before_the_next_step():
    engine = _engine(max_batch=2, gated=True)
    calls = engine.llm.backend.calls
    other, handle, at_cancel = Collect(), {}, []

    def cancel_third(sink):
        if len(sink.texts) == 3:
            at_cancel.append(len(calls))
            handle["h"].cancel()

    _submit(engine, "lazy dog", 12, other)
    handle["h"], victim = _submit(engine, "hello world", 30, Collect(on_text=cancel_third))
    engine.llm.backend.gate.set()  # both are in the run before the first decode step
    assert victim.wait().result.finish_reason == CANCELLED
    other.wait()
    later = [slots for kind, slots, _ in calls[at_cancel[0]:] if kind == "decode"]
    assert later and all(len(s) == 1 for s in later), calls  # the very next step runs without the victim
    assert other.last.result.token_ids == engine.llm.generate("lazy dog", max_new_tokens=12).token_ids
    assert engine.llm.slots_in_use == 0 and engine.in_flight == 0 and engine.stats.cancelled == 1
    engine.stop()


def test_cancelled_while_queued_is_never_prefilled():
    engine = _engine(max_batch=1, gated=True)
    _, running = _submit(engine, "hello world", 3)
    handle, queued = _submit(engine, "lazy dog", 3)
    handle.cancel()
    engine.llm.backend.gate.set()
    assert queued.wait().result.finish_reason == CANCELLED and queued.texts == []
    assert running.wait().result.finish_reason == "length"
    prefills = [slots for kind, slots, _ in engine.llm.backend.calls if kind == "prefill"]
    assert prefills == [(0,)]
    engine.stop()


def test_queue_bound_then_closed():
    engine = _engine(max_batch=2, max_queue=1, gated=True)
    sinks = [_submit(engine, p, 4)[1] for p in PROMPTS[:3]]  # 2 in slots + 1 waiting
    with pytest.raises(QueueFull, match="max-queue 1"):
        _submit(engine, PROMPTS[3], 4)
    assert engine.in_flight == 3
    engine.llm.backend.gate.set()
    assert [s.wait().result.finish_reason for s in sinks] == ["length"] * 3
    _submit(engine, PROMPTS[3], 4)[1].wait()  # room again
    engine.stop()
    with pytest.raises(EngineClosed):
        _submit(engine, PROMPTS[0], 4)


def test_stop_drains_then_cancels():
    engine = _engine(max_batch=2, gated=True)
    _, sink = _submit(engine, "hello world", 40)
    stopper = threading.Thread(target=engine.stop, kwargs={"drain_s": 0.3})
    stopper.start()
    assert _wait_until(lambda: engine._stopping)  # the gate is shut: the drain times out, the request is cancelled
    engine.llm.backend.gate.set()
    stopper.join(10)
    assert sink.wait().result.finish_reason == CANCELLED and not engine._thread.is_alive()

    engine = _engine(max_batch=2)
    _, sink = _submit(engine, "hello world", 20)
    engine.stop(drain_s=20)
    assert sink.wait().result.finish_reason == "length" and len(sink.last.result.token_ids) == 20


def test_step_error_fails_the_run_and_the_engine_goes_on():
    engine = _engine(max_batch=2, gated=True)
    a = _submit(engine, "hello world", 5)[1]
    assert _wait_until(lambda: engine.llm.slots_in_use == 1)  # prefilled; its first decode waits at the gate
    engine.llm.backend.fail_next = True
    engine.llm.backend.gate.set()
    assert a.wait().error == "generation failed: RuntimeError: device lost"
    assert engine.stats.failed == 1 and engine.llm.slots_in_use == 0 and engine.in_flight == 0
    assert _submit(engine, "hello world", 5)[1].wait().result.finish_reason == "length"
    engine.stop()


def test_finished_requests_leave_the_run_state():
    engine = _engine(max_batch=2)
    sizes, chain = [], []

    def next_short(event):  # each short request's last event submits the next one, in the same run
        if event.last:
            sizes.append(len(engine._reqs) + len(engine.llm.engine.unfinished()))
            if len(chain) < 20:
                chain.append(_submit(engine, PROMPTS[len(chain) % 6], 2, next_short)[1])

    long = Collect()
    _submit(engine, "hello world", 60, long)
    chain.append(_submit(engine, "lazy dog", 2, next_short)[1])
    long.wait()
    assert _wait_until(lambda: len(sizes) == 20)
    assert engine.stats.steps < 60 + 20 * 2 and max(sizes) <= 4, sizes  # not one entry per request ever seen
    engine.stop()


def _wait_until(cond, timeout=20.0):
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        done.wait(0.01)
    return False


def test_bad_settings_and_prompts():
    with pytest.raises(DecodertError, match="max_queue"):
        Engine(make_llm(), max_queue=-1)
    engine = _engine()
    with pytest.raises(DecodertError, match="empty"):
        engine.sequence(engine.llm.prepare([]))
    with pytest.raises(DecodertError, match="temperature"):
        engine.sequence(engine.llm.prepare([5], temperature=-1))
    engine.stop()
