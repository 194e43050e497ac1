"""The server's request bodies fuzzed (serve/): random JSON, wrong types, huge values, junk bytes.
Only a 2xx answer or a 4xx JSON error with a one-line message passes: never a 5xx, a hang or a
dead server (it must still answer a valid request after every case)."""

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).parent))
from fake_backend import make_llm  # noqa: E402
from serve_helpers import running  # noqa: E402

EXAMPLES = int(os.environ.get("DECODERT_SERVE_FUZZ", "120"))  # default run ~5 s; set it for long random runs
ODD = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                st.lists(st.integers(-3, 400), max_size=4), st.lists(st.text(max_size=4), max_size=3),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), st.just("\ud800"),
                st.just(10**400), st.just([[1, 2], [3]]), st.just({"type": "json_schema"}))
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream",
          "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "echo",
          "response_format", "stream_options", "user", "best_of", "suffix", "logit_bias", "tools"]
MESSAGES = st.one_of(ODD, st.lists(st.fixed_dictionaries({}, optional={"role": ODD | st.sampled_from(["user", "system"]),
                                                                      "content": ODD}), max_size=3))
VALID = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    llm = make_llm(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with running(llm, model_name="tiny") as (url, _app):
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client


def _check(resp):
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()
        message = json.dumps(err)
        assert "\n" not in (err.get("error") or {}).get("message", "x"), message


@settings(max_examples=EXAMPLES, deadline=None, derandomize="DECODERT_SERVE_FUZZ" not in os.environ, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       fields=st.dictionaries(st.sampled_from(FIELDS), ODD, max_size=6), messages=MESSAGES,
       base=st.sampled_from(["none", "valid"]))
def test_random_json_bodies(server, path, fields, messages, base):
    body = {**(VALID if base == "valid" else {}), **fields}
    if path.endswith("chat/completions") and "messages" not in fields:
        body.pop("prompt", None)
        body["messages"] = messages
    try:
        raw = json.dumps(body, allow_nan=True)
    except (ValueError, OverflowError):
        return
    _check(server.post(path, content=raw, headers={"content-type": "application/json"}))
    _check(server.post("/v1/completions", json=VALID))  # still alive


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": "a", "max_tokens": 1e999}',
                                 b'{"prompt": "a"' + b' ' * 100000 + b'}', b'{"a":' * 10000 + b"1" + b"}" * 10000,
                                 b'{"prompt": [1e308]}', b'{"prompt": "\\ud800", "max_tokens": 2}'])
def test_junk_bytes(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        _check(server.post(path, content=raw, headers={"content-type": "application/json"}))
    _check(server.post("/v1/completions", json=VALID))
