"""Chat sessions (runtime/chat/session.py) over the fake backend: every turn's tokens are checked against
the fake model run from scratch on the rendered conversation (tests/helpers/fake_backend.py), so a row
rewound to the wrong length or a prefill of the wrong tokens shows."""


import numpy as np
import pytest

from fake_backend import make_llm, reference_tokens  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.backends.kv_cache import common_prefix  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
COUNTED = "turns: {{ messages | length }}\n" + CHATML  # renders the start differently on every turn
QUESTIONS = ["hello world", "the quick brown fox", "jumps over the lazy dog", "héllo wörld, said the user",
             "this is a tiny test corpus", "accents and other things"]


def _llm(template=CHATML, **kw):
    kw.setdefault("max_seq", 256)
    return make_llm(chat_template=template, eos=[0], **kw)


def _expected(llm, messages, n):
    """The fake model's greedy reply to ``messages``, from scratch."""
    ids = llm.prepare(messages, chat=True).ids
    return reference_tokens(llm.backend, ids, n, stop_ids=[0])


def test_turns_match_the_full_conversation_and_prefill_only_the_new_part():
    llm = _llm(prefix_cache_mb=0)
    session = llm.session(system="be brief")
    for i, q in enumerate(QUESTIONS[:4]):
        r = session.chat(q, max_new_tokens=8)
        assert r.token_ids == _expected(llm, session.history[:-1], 8)
        assert session.history[-1] == {"role": "assistant", "content": r.text}
        info = session.last_turn
        assert info.prompt_tokens == r.metrics.prompt_tokens and info.reused_tokens == r.metrics.cached_tokens
        if i:  # everything up to the last reply is kept; only the new turn is prefilled
            assert r.metrics.cached_tokens >= len(llm.prepare(session.history[:-3], chat=True).ids), info
    assert [m["role"] for m in session.history] == ["system"] + ["user", "assistant"] * 4
    assert session.cached_tokens == r.metrics.prompt_tokens + len(r.token_ids) - 1


def test_a_template_that_renders_earlier_turns_differently_is_rewound_not_trusted():
    llm = _llm(COUNTED, prefix_cache_mb=0)
    session = llm.session()
    before = np.zeros(0, np.int64)
    for q in QUESTIONS[:3]:
        r = session.chat(q, max_new_tokens=6)
        assert r.token_ids == _expected(llm, session.history[:-1], 6)
        now = llm.prepare(session.history[:-1], chat=True).ids
        assert r.metrics.cached_tokens == common_prefix(before, now, len(now)) < 8  # "turns: N" differs at once
        before = now


def test_undo_reset_and_history():
    llm = _llm(prefix_cache_mb=0)
    session = llm.session(system="sys")
    session.chat(QUESTIONS[0], max_new_tokens=5)
    before = session.history
    session.chat(QUESTIONS[1], max_new_tokens=5)
    removed = session.undo()
    assert [m["role"] for m in removed] == ["user", "assistant"] and removed[0]["content"] == QUESTIONS[1]
    assert session.history == before
    r = session.chat(QUESTIONS[2], max_new_tokens=5)
    assert r.token_ids == _expected(llm, session.history[:-1], 5)
    assert r.metrics.cached_tokens >= len(llm.prepare(before, chat=True).ids) - 1  # rewound to before the undone turn
    session.history.append({"role": "user", "content": "not kept"})  # a copy
    session.reset()
    assert session.history == [{"role": "system", "content": "sys"}] and session.cached_tokens == 0
    r = session.chat(QUESTIONS[3], max_new_tokens=5)
    assert r.token_ids == _expected(llm, session.history[:-1], 5)
    session.reset()
    with pytest.raises(DecodertError, match="nothing to undo"):
        session.undo()


def test_a_stream_closed_early_keeps_the_reply_shown():
    llm = _llm(prefix_cache_mb=0)
    session = llm.session()
    stream = session.stream_chat(QUESTIONS[0], max_new_tokens=30)
    shown = "".join(next(stream) for _ in range(3))
    stream.close()
    assert session.history[-1] == {"role": "assistant", "content": stream.text} and stream.text.startswith(shown)
    r = session.chat(QUESTIONS[1], max_new_tokens=6)
    assert r.token_ids == _expected(llm, session.history[:-1], 6)
    deltas = list(session.stream_chat(QUESTIONS[2], max_new_tokens=6))
    assert "".join(deltas) == session.history[-1]["content"]


def test_keyboard_interrupt_in_a_step_keeps_the_session_usable():
    llm = _llm(prefix_cache_mb=0)
    session = llm.session()
    session.chat(QUESTIONS[0], max_new_tokens=4)
    decode, calls = llm.backend.decode, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return decode(*a, **kw)

    llm.backend.decode = interrupted
    with pytest.raises(KeyboardInterrupt):
        session.chat(QUESTIONS[1], max_new_tokens=10)
    llm.backend.decode = decode
    assert session.history[-2]["content"] == QUESTIONS[1]  # the partial reply is kept, as shown
    r = session.chat(QUESTIONS[2], max_new_tokens=6)
    assert r.token_ids == _expected(llm, session.history[:-1], 6) and llm.slots_in_use == 0


def test_overflow_truncate_drops_the_oldest_turns_and_goes_on():
    llm = _llm(max_seq=96, prefix_cache_mb=0)
    session = llm.session(system="sys")
    dropped = 0
    for i in range(12):
        r = session.chat(QUESTIONS[i % len(QUESTIONS)], max_new_tokens=12)
        info = session.last_turn
        dropped += info.dropped_turns
        assert r.token_ids == _expected(llm, session.history[:-1], 12)
        assert session.history[0] == {"role": "system", "content": "sys"}
        assert info.prompt_tokens + 12 <= 96
        if info.dropped_turns:
            assert info.prompt_tokens <= 48  # down to half the context: re-prefills stay rare
    assert dropped >= 3


def test_overflow_error_leaves_the_session_as_it_was():
    llm = _llm(max_seq=96, prefix_cache_mb=0)
    session = llm.session(system="sys", overflow="error")
    with pytest.raises(DecodertError, match="overflow='truncate'"):
        for i in range(20):
            session.chat(QUESTIONS[i % len(QUESTIONS)], max_new_tokens=12)
    before = session.history
    with pytest.raises(DecodertError, match=r"context holds 96"):
        session.chat("one more", max_new_tokens=12)
    assert session.history == before
    session.undo()
    r = session.chat("x", max_new_tokens=4)
    assert r.token_ids == _expected(llm, session.history[:-1], 4)


def test_cut_by_context_or_by_max_new_tokens():
    llm = make_llm(chat_template=CHATML, max_seq=48, prefix_cache_mb=0)  # no eos: answers run to a limit
    session = llm.session()
    r = session.chat("hi", max_new_tokens=4)
    assert r.finish_reason == "length" and session.last_turn.cut_by == "max_new_tokens"
    r = session.chat("hi", max_new_tokens=100)  # room kept: min(100, 48 // 2); the rest runs into the end
    assert r.finish_reason == "length" and session.last_turn.cut_by == "context"
    assert r.metrics.prompt_tokens + len(r.token_ids) == 48


def test_a_message_too_long_for_the_context_is_refused():
    llm = _llm(max_seq=48, prefix_cache_mb=0)
    session = llm.session(system="sys")
    with pytest.raises(DecodertError, match="send a shorter message"):
        session.chat("the quick brown fox " * 30, max_new_tokens=4)
    assert session.history == [{"role": "system", "content": "sys"}]


def test_sessions_share_the_system_prompt_through_the_prefix_cache():
    llm = _llm()
    system = "héllo wörld: accents and other things, said the user to the assistant. " * 3
    first = llm.session(system=system).chat(QUESTIONS[0], max_new_tokens=4)
    second = llm.session(system=system).chat(QUESTIONS[1], max_new_tokens=4)
    assert first.metrics.cached_tokens == 0 and second.metrics.cached_tokens >= 32
    assert second.token_ids == _expected(llm, [{"role": "system", "content": system},
                                               {"role": "user", "content": QUESTIONS[1]}], 4)


@pytest.mark.parametrize("kwargs, match", [({"overflow": "drop"}, "unknown overflow policy"),
                                           ({"system": 5}, "system message must be a string")])
def test_bad_session_arguments(kwargs, match):
    with pytest.raises(DecodertError, match=match):
        _llm().session(**kwargs)


def test_bad_messages_and_parameters_change_nothing():
    session = _llm().session()
    with pytest.raises(DecodertError, match="chat message 0"):
        session.chat({"content": "no role"})
    with pytest.raises(DecodertError, match="unknown generation parameter"):
        session.chat("hi", max_tokens=3)
    assert session.history == [] and session.cached_tokens == 0


def test_speculative_turns_match_plain_turns():
    def rule(h):  # copies its context: prompt-lookup drafts are often right
        return int(h[(len(h) - 7) % len(h)])

    plain, spec = _llm(rule=rule, prefix_cache_mb=0).session(), _llm(rule=rule, prefix_cache_mb=0).session()
    for q in QUESTIONS[:3]:
        expected = plain.chat(q, max_new_tokens=20).token_ids
        assert spec.chat(q, max_new_tokens=20, speculative="ngram").token_ids == expected
    assert spec.history == plain.history
    assert any(kind == "verify" for kind, _, _ in spec.llm.backend.calls)
