"""logprobs, logit_bias and n with seed: in the Python API and through the official openai client against a
real server on loopback (issue 34)."""

import math

import numpy as np
import pytest

from fake_backend import make_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402

CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def llm():
    return make_llm(eos=[0], max_seq=256, max_batch=4,
                    chat_template="{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>")


def _sane(entries, k):
    for e in entries:
        assert e.logprob <= 0 and all(lp <= 0 for _, lp in e.top)
        assert len(e.top) == k and [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)


def test_api_greedy_logprobs_are_the_log_softmax_and_the_top_one_is_chosen(llm):
    r = llm.generate("hello", max_new_tokens=6, temperature=0, logprobs=True, top_logprobs=4)
    plain = llm.generate("hello", max_new_tokens=6, temperature=0)
    assert r.token_ids == plain.token_ids and plain.logprobs is None
    assert [e.token_id for e in r.logprobs] == r.token_ids
    _sane(r.logprobs, 4)
    assert all(e.top[0] == (e.token_id, e.logprob) for e in r.logprobs)
    assert r.to_dict()["logprobs"][0]["token_id"] == r.token_ids[0]


def test_api_sampled_logprobs_come_from_the_sampled_distribution(llm):
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.7, seed=11)
    r = llm.generate("hello", logprobs=True, top_logprobs=20, **kw)
    assert r.token_ids == llm.generate("hello", **kw).token_ids  # the same draws as without logprobs
    for e in r.logprobs:
        assert e.token_id in {t for t, _ in e.top} and math.isfinite(e.logprob)
        mass = sum(math.exp(lp) for _, lp in e.top)
        assert mass <= 1 + 1e-9 and len(e.top) <= 20
    # top_p 0.7 leaves few tokens: their probabilities (after temperature and top-p) add up to 1
    assert any(abs(sum(math.exp(lp) for _, lp in e.top) - 1) < 1e-9 for e in r.logprobs)


def test_api_logprobs_follow_the_structured_output_mask(llm):
    r = llm.generate("hello", max_new_tokens=6, temperature=0, regex="[ab]+", logprobs=True, top_logprobs=5)
    for e in r.logprobs:
        for t, _ in e.top:  # only tokens the grammar allows have a probability
            assert t == 0 or set(llm.tokenizer.decode([t])) <= {"a", "b"}, llm.tokenizer.decode([t])


def test_api_logprobs_turn_speculation_off_for_the_row(llm):
    plain = llm.generate("hello hello hello", max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    spec = llm.generate("hello hello hello", max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                        speculative="ngram")
    assert spec.logprobs == plain.logprobs and spec.token_ids == plain.token_ids


def test_api_logit_bias_bans_and_forces(llm):
    first = llm.generate("hello", max_new_tokens=4, temperature=0).token_ids[0]
    assert first not in llm.generate("hello", max_new_tokens=4, temperature=0, logit_bias={first: -100}).token_ids
    assert llm.generate("hello", max_new_tokens=4, temperature=1.0, seed=1, logit_bias={7: 100}).token_ids == [7] * 4
    for bad, message in (({10**6: 1}, "outside the vocabulary"), ({1: 101}, "logit_bias must be"),
                         ({"1": 1}, "logit_bias must be"), ({1: float("nan")}, "logit_bias must be")):
        with pytest.raises(DecodertError, match=message):
            llm.generate("hello", logit_bias=bad)
    with pytest.raises(DecodertError, match="top_logprobs needs logprobs=True"):
        llm.generate("hello", top_logprobs=3)


# --- the server, through the openai client ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(llm):
    pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
    from serve_helpers import running

    with running(llm) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_logprobs_greedy_and_streamed(client):
    kw = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert bytes(e.bytes).decode("utf-8") == e.token
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                for ch in c.choices if ch.logprobs and ch.logprobs.content for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_and_stream(client):
    kw = dict(model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=3)
    lp = client.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) <= 3 and max(top.values()) == logprob and top[token] == logprob
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices[0].logprobs]
    assert sum((c.tokens for c in chunks), []) == lp.tokens
    assert sum((c.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset


def test_logit_bias_bans_and_forces_through_the_server(client, llm):
    base = dict(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    first = llm.generate("hello", max_new_tokens=1, temperature=0).token_ids[0]
    banned = client.completions.create(**base, logit_bias={str(first): -100}, logprobs=0).choices[0].logprobs
    assert llm.tokenizer.decode([first], skip_special_tokens=False) not in banned.tokens
    forced = client.completions.create(**{**base, "temperature": 1.0}, logit_bias={"7": 100})
    assert forced.choices[0].text == llm.tokenizer.decode([7] * 4)


def test_n_with_seed_is_reproducible_and_the_choices_differ(client):
    kw = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=1.0, n=4, seed=1234)
    first = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert first == [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert len(set(first)) > 1
    other = [c.message.content for c in client.chat.completions.create(**{**kw, "seed": 99}).choices]
    assert other != first


@pytest.mark.parametrize("path, extra, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("chat", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprob_and_bias_fields_are_400(url, path, extra, param):
    httpx = pytest.importorskip("httpx")
    body = {"model": "tiny", "max_tokens": 2, **({"messages": CHAT} if path == "chat" else {"prompt": "a"}), **extra}
    r = httpx.post(f"{url}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"], r.text


def test_logprobs_on_an_exported_ort_model(tmp_path):
    """The ort backend hands the logits over when only logprobs ask for them (greedy, no processors)."""
    from serve_helpers import export_tiny

    from decodert.runtime.llm import LLM

    real = LLM.load(export_tiny(tmp_path, max_batch=2, max_seq=64))
    r = real.generate("hello", max_new_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    assert r.token_ids == real.generate("hello", max_new_tokens=5, temperature=0).token_ids
    _sane(r.logprobs, 3)
    assert all(e.top[0][0] == e.token_id and e.top[0][1] == e.logprob for e in r.logprobs)
