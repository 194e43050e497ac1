"""One LLM from several threads (runtime/llm.py): runs serialise and give the single-threaded
results; a stream left open by a thread that has exited does not block the object; an interrupt
in the middle of a stream leaves the same greedy output for the next call."""

import threading

import pytest

from fake_backend import make_llm  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox", "lazy dog", "héllo wörld"]


def _in_thread(fn, timeout=20):
    """Run fn in a thread; (finished?, its result)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def test_a_stream_left_open_by_an_exited_thread_does_not_block():
    llm = make_llm()
    expected = llm.generate("hi", max_new_tokens=5).token_ids
    kept = []

    def leave_open():
        s = llm.stream("the quick", max_new_tokens=50)
        next(s)
        kept.append(s)  # the stream outlives its thread

    t = threading.Thread(target=leave_open)
    t.start()
    t.join()
    finished, result = _in_thread(lambda: llm.generate("hi", max_new_tokens=5))
    assert finished and result.token_ids == expected
    assert llm.slots_in_use == 0


def test_a_live_threads_open_stream_still_blocks_until_busy_timeout():
    from decodert.errors import DecodertError

    llm = make_llm()
    s = llm.stream("the quick", max_new_tokens=50)
    next(s)
    llm.busy_timeout = 0.3
    finished, result = _in_thread(lambda: _error_of(lambda: llm.generate("hi", max_new_tokens=2)))
    assert finished and isinstance(result, DecodertError) and "busy" in str(result)
    s.close()
    assert len(llm.generate("hi", max_new_tokens=2).token_ids) == 2


def _error_of(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - returned to the test thread
        return e


def test_four_threads_equal_single_threaded():
    llm = make_llm()
    single = {p: llm.generate(p, max_new_tokens=8).text for p in PROMPTS}
    sampled = {p: llm.generate(p, max_new_tokens=8, temperature=0.9, seed=3).token_ids for p in PROMPTS}
    results, errors = [], []

    def work(i):
        try:
            for k in range(5):
                p = PROMPTS[(i + k) % 4]
                if k % 2:
                    results.append((p, "greedy", "".join(llm.stream(p, max_new_tokens=8)), None))
                else:
                    r = llm.generate(p, max_new_tokens=8, temperature=0.9, seed=3)
                    results.append((p, "sampled", None, r.token_ids))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 20
    for p, kind, text, ids in results:
        if kind == "greedy":
            assert text == single[p]
        else:
            assert ids == sampled[p]
    assert llm.slots_in_use == 0


@pytest.mark.parametrize("where", ["consumer", "backend"])
def test_interrupt_mid_stream_then_the_same_greedy_output(where, monkeypatch):
    llm = make_llm()
    expected = llm.generate("the quick brown fox", max_new_tokens=12).token_ids
    if where == "backend":
        real, calls = llm.backend.decode, []

        def decode(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(llm.backend, "decode", decode)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(llm.stream("the quick brown fox", max_new_tokens=12)):
            if where == "consumer" and i == 3:
                raise KeyboardInterrupt
    monkeypatch.undo()
    assert llm.slots_in_use == 0
    assert llm.generate("the quick brown fox", max_new_tokens=12).token_ids == expected
