"""The server's request bodies fuzzed (serve/): random JSON, wrong types, huge values, junk bytes.
Only a 2xx answer or a 4xx JSON error with a one-line message passes: never a 5xx, a hang or a
dead server (it must still answer a valid request after every case)."""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
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
JSON = {"content-type": "application/json"}


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


# --- slow clients: on loopback, a bounded number of them, each test bounded in time ----------------------------

def _raw_post(port: int, body: bytes, rcvbuf: int | None = None, length: int | None = None):
    """A socket that has sent a POST's headers (Content-Length ``length``, default len(body)) and no body yet."""
    import socket

    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small receive window
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    path = b"/v1/completions"
    s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body) if length is None else length).encode() + b"\r\n\r\n")
    return s


def _read_all(s, chunk: int = 65536, pause: float = 0.0) -> bytes:
    import time

    got = []
    while True:
        part = s.recv(chunk)
        if not part:
            return b"".join(got)
        got.append(part)
        if pause:
            time.sleep(pause)


def _sse_text(raw: bytes) -> tuple[str, bool]:
    """(the streamed completion text, whether it ended with [DONE]) from a raw chunked SSE response."""
    datas = [line[6:] for line in raw.decode("utf-8", "replace").splitlines() if line.startswith("data: ")]
    text = "".join(c["text"] for d in datas if d != "[DONE]" for c in json.loads(d).get("choices", []))
    return text, bool(datas) and datas[-1] == "[DONE]"


def test_slow_clients_do_not_stall_the_others():
    """3 clients that send their body byte by byte, 3 that never read their stream, 1 that reads it a few bytes
    at a time: meanwhile 8 ordinary requests are answered, correctly; then every slow client gets its full answer
    and the slots come free."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    llm = make_llm(max_seq=1024, max_batch=4)
    want = llm.generate("hello", max_new_tokens=8, temperature=0.0).text
    long_want = llm.generate("hello", max_new_tokens=600, temperature=0.0).text
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}).encode()
    stream_body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 600, "temperature": 0,
                              "stream": True}).encode()
    with running(llm, model_name="tiny", client_timeout_s=60) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        stalled = [_raw_post(port, stream_body, rcvbuf=2048) for _ in range(3)]
        for s in stalled:
            s.sendall(stream_body)  # and never read
        started = threading.Barrier(5)

        def dribble():
            s = _raw_post(port, body)
            started.wait(10)
            for i in range(len(body)):
                s.sendall(body[i:i + 1])
                time.sleep(0.02)
            return _read_all(s)

        def trickle():
            s = _raw_post(port, stream_body)
            s.sendall(stream_body)
            started.wait(10)
            return _read_all(s, chunk=64, pause=0.002)

        with ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(dribble) for _ in range(3)] + [pool.submit(trickle)]
            started.wait(10)
            with httpx.Client(base_url=url, timeout=10) as h:  # 10 s each: a stalled server fails here
                ordinary = [h.post("/v1/completions", content=body, headers=JSON) for _ in range(8)]
                assert not any(f.done() for f in slow[:3]), "the byte-by-byte bodies should still be arriving"
            assert [r.json()["choices"][0]["text"] for r in ordinary] == [want] * 8
            for f in slow[:3]:
                raw = f.result(30)
                assert raw.startswith(b"HTTP/1.1 200") and json.loads(raw.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == want
            assert _sse_text(slow[3].result(60)) == (long_want, True)
        for s in stalled:  # the stalled readers' generations ran on regardless; their bytes wait in buffers
            assert _sse_text(_read_all(s)) == (long_want, True)
            s.close()
        deadline = time.time() + 10
        while app.state.engine.in_flight and time.time() < deadline:
            time.sleep(0.01)
        assert app.state.engine.in_flight == 0 and httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_body_that_stops_arriving_gets_408():
    import time

    with running(make_llm(), model_name="tiny", client_timeout_s=0.5) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        s = _raw_post(port, b"", length=100)
        s.sendall(b'{"model": "tiny", "pro')  # ... and nothing more
        t0 = time.monotonic()
        raw = _read_all(s)
        assert time.monotonic() - t0 < 10
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), raw[:200]
        err = json.loads(payload)["error"]
        assert err["code"] == "request_timeout" and "--client-timeout" in err["message"]
        s.close()
        _check(httpx.post(f"{url}/v1/completions", json=VALID))
        assert httpx.post(f"{url}/v1/completions", json={**VALID, "model": "tiny"}).status_code == 200


def test_a_reader_that_stops_reading_is_dropped():
    """A stream whose client takes no bytes for --client-timeout is closed (counted in /metrics); others go on."""
    import time

    llm = make_llm(max_seq=4096, max_batch=4)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4000, "temperature": 0, "n": 4,
                       "stream": True}).encode()
    # small socket buffers on both ends, so the unread stream backs up into the server within the test's time
    with running(llm, model_name="tiny", client_timeout_s=1.0, sndbuf=4096) as (url, app):
        s = _raw_post(int(url.rsplit(":", 1)[1]), body, rcvbuf=2048)
        s.sendall(body)
        deadline = time.time() + 30
        metric = "decodert_stalled_readers_total 1.0"
        while metric not in httpx.get(f"{url}/metrics").text and time.time() < deadline:
            assert httpx.post(f"{url}/v1/completions", json={**VALID, "model": "tiny"}, timeout=10).status_code == 200
            time.sleep(0.2)
        assert metric in httpx.get(f"{url}/metrics").text
        text, done = _sse_text(_read_all(s))
        assert not done and len(text) > 0  # cut off: what was buffered, then the end of the connection
        s.close()
        deadline = time.time() + 10
        while app.state.engine.in_flight and time.time() < deadline:
            time.sleep(0.01)
        assert app.state.engine.in_flight == 0
