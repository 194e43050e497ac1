"""`decodert serve` (serve/): a real server on loopback, driven by the official openai client and raw httpx."""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from serve_helpers import export_tiny, running  # noqa: E402

from decodert.runtime.llm import LLM  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world, a tiny", "numbers 12 345", "jumps over the lazy dog",
           "a tiny model for", "punctuation: ; , ."]
CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("serve"), max_batch=4, max_seq=256)


@pytest.fixture(scope="module")
def llm(art):
    return LLM.load(art)


class Slow:
    """A backend whose decode steps take at least ``delay`` seconds (keeps requests in flight for a while)."""

    def __init__(self, inner, delay: float) -> None:
        self._inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def decode(self, *args, **kwargs):
        time.sleep(self.delay)
        return self._inner.decode(*args, **kwargs)


class Gated(Slow):
    """A backend whose decode steps wait until ``gate`` is set."""

    def __init__(self, inner) -> None:
        import threading

        super().__init__(inner, 0.0)
        self.gate, self.waiting = threading.Event(), threading.Event()

    def decode(self, *args, **kwargs):
        self.waiting.set()
        assert self.gate.wait(30), "test gate never opened"
        return self._inner.decode(*args, **kwargs)


def slow_llm(llm, delay=0.02):
    return LLM(Slow(llm.backend, delay), llm.tokenizer, llm.manifest)


def client(url, key="none"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def scrape(url) -> dict[str, float]:
    """The /metrics samples as {name{labels}: value}."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_openai_client_sync_and_streaming(llm):
    want = llm.generate(PROMPTS[0], max_new_tokens=12, temperature=0.0)
    want_chat = llm.chat(CHAT, max_new_tokens=10, temperature=0.0)
    with running(llm) as (url, _):
        c = client(url)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(llm.encode(PROMPTS[0])), 12)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0)
        assert r.choices[0].message.content == want_chat.text and r.choices[0].message.role == "assistant"

        chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2
        chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_chat.text
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 10 and all(ch.usage is None for ch in chunks[:-1])


def test_raw_stream_ends_with_done(llm):
    with running(llm) as (url, _):
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"


def test_sampling_fields_match_offline(llm):
    base = llm.generate(PROMPTS[2], max_new_tokens=30, temperature=0.0).text
    stop = base[8:11]
    cases = [  # (request fields, offline keyword arguments)
        ({"temperature": 1.0, "top_p": 0.9, "seed": 7}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}),
        ({"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.5},
         {"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.5}),
        ({"temperature": 0, "stop": [stop, "zzz"]}, {"temperature": 0.0, "stop": [stop, "zzz"]}),
    ]
    wants = [llm.generate(PROMPTS[2], max_new_tokens=30, **kw) for _, kw in cases]
    with running(llm) as (url, _):
        c = client(url)
        for (fields, _), want in zip(cases, wants):
            r = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, **fields)
            assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason), fields
        assert wants[2].finish_reason == "stop" and stop not in wants[2].text
        r = c.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=6, temperature=1, seed=3, n=2)
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 24
        assert r.choices[0].text == llm.generate(PROMPTS[0], max_new_tokens=6, temperature=1.0, seed=3).text
        assert r.choices[1].text == llm.generate(PROMPTS[0], max_new_tokens=6, temperature=1.0, seed=4).text


def test_concurrent_clients_share_the_batch_and_match_offline(llm):
    jobs = [(i % 3, PROMPTS[i % len(PROMPTS)], 8 + (i * 5) % 17) for i in range(24)]  # (kind, prompt, max_tokens)

    def offline(kind, prompt, n):
        if kind == 2:
            return llm.chat([{"role": "user", "content": prompt}], max_new_tokens=n, temperature=0.0)
        return llm.generate(prompt, max_new_tokens=n, temperature=0.0)

    results = [offline(*job) for job in jobs]
    wants = [r.text for r in results]
    with running(llm) as (url, _):
        c = client(url)

        def ask(job):
            kind, prompt, n = job
            if kind == 0:
                return c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text
            if kind == 1:
                stream = c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True)
                return "".join(ch.choices[0].text for ch in stream)
            stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=n, temperature=0, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(ask, jobs))
        m = scrape(url)
    assert got == wants
    tokens = sum(n for _, _, n in jobs)
    assert m["decodert_generation_tokens_total"] == tokens and m["decodert_engine_rows"] == tokens
    # one request at a time needs one step per token; 8 clients over 4 slots share steps
    assert m["decodert_engine_steps"] <= 0.6 * tokens, m
    assert m['decodert_requests_total{endpoint="/v1/completions",status="200"}'] == 16
    # the histograms saw every request once, with plausible times; the queue and the slots are empty again
    assert m["decodert_time_to_first_token_seconds_count"] == 24 == m["decodert_time_per_output_token_seconds_count"]
    assert 0 < m["decodert_time_to_first_token_seconds_sum"] < 24 * 60 and m["decodert_time_per_output_token_seconds_sum"] > 0
    assert m['decodert_request_finished_total{reason="length"}'] == 24
    assert m["decodert_prompt_tokens_total"] == sum(r.metrics.prompt_tokens for r in results)
    assert (m["decodert_queue_depth"], m["decodert_slots_in_use"], m["decodert_slots"]) == (0, 0, 4)


def test_disconnect_mid_stream_frees_the_slot(llm):
    with running(slow_llm(llm)) as (url, app):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert app.state.engine.llm.slots_in_use == 1
        deadline = time.time() + 5
        while app.state.engine.in_flight and time.time() < deadline:
            time.sleep(0.01)
        m = scrape(url)
        assert m['decodert_request_finished_total{reason="cancelled"}'] == 1
        assert m["decodert_slots_in_use"] == 0 and m["decodert_generation_tokens_total"] < 60
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        r = client(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason == "length"

        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
            httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(5, read=0.5))
        deadline = time.time() + 5
        while app.state.engine.in_flight and time.time() < deadline:
            time.sleep(0.01)
        m = scrape(url)
        assert m['decodert_request_finished_total{reason="cancelled"}'] == 2 and m["decodert_slots_in_use"] == 0
        assert m["decodert_generation_tokens_total"] < 4 + 2 * 100  # both stopped long before 200 tokens


def test_event_loop_answers_while_a_step_runs(llm):
    gated = Gated(llm.backend)
    with running(LLM(gated, llm.tokenizer, llm.manifest)) as (url, _):
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client(url).completions.create, model="tiny", prompt="hello", max_tokens=5, temperature=0)
            assert gated.waiting.wait(30)  # the engine thread is inside a decode step, and stays there
            assert httpx.get(f"{url}/health", timeout=5).json()["slots_in_use"] == 1
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "a", "temperature": "x"}, timeout=5)
            assert r.status_code == 400  # requests are parsed and answered meanwhile
            gated.gate.set()
            assert pending.result(30).usage.completion_tokens == 5


def test_full_queue_answers_429(llm):
    with running(slow_llm(llm), max_queue=1) as (url, app):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as h:
            streams = [h.stream("POST", f"{url}/v1/completions", json=body) for _ in range(5)]  # 4 slots + 1 queued
            opened = [s.__enter__() for s in streams]
            try:
                lines = [r.iter_lines() for r in opened]  # kept: a dropped iterator closes its connection
                for it in lines[:4]:
                    next(it)  # admitted: its first chunk came
                assert app.state.engine.in_flight == 5 and app.state.engine.queued == 1
                r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "rate_limit_exceeded" and "--max-queue 1" in r.json()["error"]["message"]
                with pytest.raises(openai.RateLimitError):
                    client(url).completions.create(model="tiny", prompt="a", max_tokens=2)
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        deadline = time.time() + 5
        while app.state.engine.in_flight and time.time() < deadline:
            time.sleep(0.01)
        assert client(url).completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None


def test_api_key(llm):
    with running(llm, api_key="s3cret") as (url, _):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        with pytest.raises(openai.AuthenticationError):
            client(url, key="nope").models.list()
        assert client(url, key="s3cret").completions.create(**body).choices[0].finish_reason == "length"
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


BAD = [  # (path, body, status, param or a word of the message)
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [True]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"prompt": "a"}, 400, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 300}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "a " * 300, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
]


def test_bad_requests_get_openai_errors(llm):
    with running(llm, max_body_bytes=4000) as (url, _):
        for path, body, status, param in BAD:
            r = httpx.post(url + path, json=body)
            err = r.json()["error"]
            assert r.status_code == status and err["type"] == "invalid_request_error", (body, r.text)
            assert err["param"] == param and err["message"], (body, err)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 300})
        assert r.json()["error"]["code"] == "context_length_exceeded" and "256" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(10):
                yield b"x" * 1000  # chunked: no Content-Length, the limit is counted as the bytes arrive
            yield b'"}'

        assert httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}).status_code == 413
        assert httpx.get(f"{url}/v1/models/gpt-4").status_code == 404
        r = httpx.get(f"{url}/v1/nothing")
        assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/completions").json()["error"]["message"] == "GET is not allowed on /v1/completions"
        assert client(url).completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens == 2


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_structured_output(llm):
    from decodert.runtime.closing import strict_schema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    with running(llm) as (url, _):  # the mini model's manifest has no eos: structured output cannot end
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "response_format": fmt})
        assert r.status_code == 400 and "eos" in r.json()["error"]["message"]
    llm = LLM(llm.backend, llm.tokenizer, llm.manifest.replace(tokenizer=llm.manifest.tokenizer.replace(eos_token_ids=(0,))))
    # response_format json_schema is strict by default: unlisted keys refused, compact JSON (runtime/closing.py)
    want = llm.chat(CHAT, max_new_tokens=60, temperature=0.0, json_schema=strict_schema(SCHEMA, compact=True))
    with running(llm) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0, response_format=fmt)
        assert r.choices[0].message.content == want.text
        if r.choices[0].finish_reason == "stop":
            assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}
        r = c.completions.create(model="tiny", prompt="a", max_tokens=40, temperature=0,
                                 extra_body={"response_format": {"type": "json_object"}})
        assert r.choices[0].text.lstrip().startswith("{")
        for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                    {"type": "json_schema"}, {"type": "xml"}):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "response_format": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_speculative_requests_match_plain_greedy(llm, monkeypatch):
    """The server's default and a request's own ``speculative`` verify drafts, "off" never does, and
    every reply is plain greedy's text. The planner's step costs are pinned (a verify pass priced as
    a decode step), so whether it speculates does not hang on this machine's timing."""
    from decodert.runtime.speculation import speculative

    prompt = "the quick brown fox the quick brown fox the quick"
    want = llm.generate(prompt, max_new_tokens=40, temperature=0.0)
    monkeypatch.setattr(speculative.StepCosts, "estimate", lambda self, rows, width: 1e-3)
    verifies = []
    real = llm.backend.verify
    monkeypatch.setattr(llm.backend, "verify", lambda *a, **k: (verifies.append(1), real(*a, **k))[1])
    with running(llm, speculative="ngram") as (url, app):
        c = client(url)
        passes = {}
        for name, extra in (("default", {}), ("ngram", {"speculative": "ngram"}), ("off", {"speculative": "off"})):
            before, steps = len(verifies), scrape(url)["decodert_engine_steps"]
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body=extra)
            assert r.choices[0].text == want.text and r.usage.completion_tokens == 40, extra
            passes[name] = (len(verifies) - before, scrape(url)["decodert_engine_steps"] - steps)
        assert passes["off"] == (0, 40) and passes["default"][0] > 0 and passes["ngram"][0] > 0, passes
        for bad, word in (({"speculative": "magic"}, "speculative must be one of"), ({"speculative": "draft"}, "draft model")):
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "a", **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text
            assert word in r.json()["error"]["message"]


def test_prefix_cache_hits_show_in_usage_and_metrics(llm):
    """A prompt that starts like an earlier one reuses its K/V blocks (runtime/prefix_cache.py): same text, cached tokens."""
    cached_llm = LLM(llm.backend, llm.tokenizer, llm.manifest, prefix_cache_mb=8)
    shared = "the quick brown fox jumps over the lazy dog, hello world, a tiny model for fuzzing decodert. " * 2
    want = [llm.generate(shared + tail, max_new_tokens=8, temperature=0.0).text for tail in ("12", "345")]
    with running(cached_llm) as (url, _):
        c = client(url)
        first = c.completions.create(model="tiny", prompt=shared + "12", max_tokens=8, temperature=0)
        second = c.completions.create(model="tiny", prompt=shared + "345", max_tokens=8, temperature=0)
        m = scrape(url)
    assert [first.choices[0].text, second.choices[0].text] == want
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit >= 64 and hit < second.usage.prompt_tokens  # whole 32-token blocks of the shared start
    assert m["decodert_prefix_cache_hit_tokens_total"] == hit and m["decodert_prefix_cache_hits_total"] == 1


def test_structured_output_without_llguidance_is_a_server_error(art, monkeypatch):
    """llguidance missing from the server's environment is the server's fault: 500 with the install hint, not 400."""
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    fmt = {"type": "json_object"}
    with running(LLM.load(art)) as (url, _):  # a fresh LLM: its guidance is not built yet
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "response_format": fmt})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error" and "pip install" in r.json()["error"]["message"]


def test_the_servers_draft_len_applies_to_requests_that_pick_a_method(llm, monkeypatch):
    """`decodert serve --speculative ngram --draft-len 2`: a request's own "ngram" keeps the server's draft length."""
    from decodert.runtime.engine.thread import EngineThread as Engine
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    seen = []
    real = Engine.speculation
    monkeypatch.setattr(Engine, "speculation", lambda self, value: (seen.append(value), real(self, value))[1])
    prompt = "the quick brown fox the quick brown fox the quick"
    want = llm.generate(prompt, max_new_tokens=12, temperature=0.0)
    with running(llm, speculative=SpeculativeConfig(method="ngram", draft_len=2)) as (url, _):
        for extra in ({}, {"speculative": "ngram"}):
            r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
            assert r.choices[0].text == want.text
    assert [getattr(v, "draft_len", None) for v in seen] == [2, 2], seen
