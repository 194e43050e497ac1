"""The cache-state rule on the real model: a speculative conversation kept in a session, and the same
conversation sent to the OpenAI server turn by turn with its whole history (prefix cache on,
speculation on, as every OpenAI client does), give the tokens of a plain re-prefill of each turn."""

from __future__ import annotations


import pytest


from decodert.runtime.llm import LLM  # noqa: E402

QUESTIONS = ["Repeat this sentence exactly: the cat sat on the mat near the door.",
             "Now write it again, but replace cat with dog.",
             "List the words of that last sentence, one per line.",
             "Repeat your previous answer exactly."]
NEW = 40


@pytest.fixture(scope="module")
def smol_art(smollm2_gguf, tmp_path_factory):
    from decodert.export.pipeline import export_model

    art = tmp_path_factory.mktemp("smol-state") / "art"
    export_model(smollm2_gguf, art, target="ort", dtype="fp32", max_seq=1024, max_batch=2, progress=False)
    return art


def _plain(llm: LLM, history: list[dict]) -> list[int]:
    return llm.chat(history, max_new_tokens=NEW, temperature=0).token_ids


def test_speculative_session_matches_plain_reprefill(smol_art):
    spec = LLM.load(smol_art)  # prefix cache on (the default)
    plain = LLM.load(smol_art, prefix_cache_mb=0)
    session = spec.session(system="You are a careful assistant.")
    verified = 0
    for q in QUESTIONS:
        r = session.chat(q, max_new_tokens=NEW, temperature=0, speculative="ngram")
        assert r.token_ids == _plain(plain, session.history[:-1]), q
        verified += r.metrics.accepted_per_step > 1
    assert verified >= 1  # some turns really ran verify passes that accepted drafts
    before = session.history
    stream = session.stream_chat("Write a long story about the mat.", max_new_tokens=NEW, temperature=0, speculative="ngram")
    next(stream)
    session.undo()  # mid-stream: cancelled, nothing kept
    assert list(stream) == [] and session.history == before
    r = session.chat(QUESTIONS[0], max_new_tokens=NEW, temperature=0, speculative="ngram")
    assert r.token_ids == _plain(plain, session.history[:-1])


def test_server_whole_history_each_turn_matches_plain_reprefill(smol_art):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_helpers import running

    served = LLM.load(smol_art)  # prefix cache on
    plain = LLM.load(smol_art, prefix_cache_mb=0)
    messages: list[dict] = [{"role": "system", "content": "You are a careful assistant."}]
    with running(served, "smol", speculative="ngram") as (url, _):
        for q in QUESTIONS:
            messages.append({"role": "user", "content": q})
            body = {"model": "smol", "messages": messages, "max_tokens": NEW, "temperature": 0}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            want = plain.chat(messages, max_new_tokens=NEW, temperature=0)
            assert text == want.text, q
            messages.append({"role": "assistant", "content": text})
    assert served.prefix_cache.stats.hits >= len(QUESTIONS) - 1
