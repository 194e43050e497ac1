"""The holes a hostile trial found in `decodert serve` (issue 34), each against a real server on loopback:
Host / Content-Type checks, an empty API key, a client gone mid-body, slow-loris headers, schemas that
only failed at the first step, requests that can never fit, an unknown model."""

import json
import logging
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from fake_backend import make_llm  # noqa: E402
from serve_helpers import running  # noqa: E402

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    return make_llm(eos=[0], max_seq=256, max_batch=4)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_host_header_must_name_this_server(llm):
    with running(llm) as (url, _):
        port = _port(url)
        for host in ("evil.example", f"evil.example:{port}", "10.1.2.3", f"127.0.0.2:{port}"):
            r = httpx.post(f"{url}/v1/completions", json=BODY, headers={"Host": host})
            assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)
            assert "--allowed-hosts" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", headers={"Host": "evil.example"}).status_code == 421
        for host in (f"127.0.0.1:{port}", "localhost", f"localhost:{port}", "[::1]", f"[::1]:{port}", "LOCALHOST"):
            assert httpx.post(f"{url}/v1/completions", json=BODY, headers={"Host": host}).status_code == 200, host
    with running(llm, allowed_hosts=("api.example", "other.example:8443")) as (url, _):
        ok = {"api.example": 200, "api.example:99": 200, "other.example:8443": 200, "other.example": 421, "x.y": 421}
        for host, status in ok.items():
            assert httpx.post(f"{url}/v1/completions", json=BODY, headers={"Host": host}).status_code == status, host
    with running(llm, allowed_hosts=("*",)) as (url, _):
        assert httpx.post(f"{url}/v1/completions", json=BODY, headers={"Host": "anything"}).status_code == 200


def test_posts_need_a_json_content_type(llm):
    with running(llm) as (url, _):
        raw = json.dumps(BODY)
        for kind in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            headers = {"content-type": kind} if kind else {}
            r = httpx.post(f"{url}/v1/completions", content=raw, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
        for kind in ("application/json", "Application/JSON; charset=utf-8"):
            assert httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": kind}).status_code == 200


def test_a_client_gone_mid_body_is_one_log_line_and_a_499(llm):
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append
    with running(llm) as (url, _):
        logger = logging.getLogger("uvicorn.error")
        logger.addHandler(handler)
        try:
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000\r\n\r\n{\"model\": \"ti")
                    time.sleep(0.2)
            deadline = time.time() + 10
            while _metric(url, 'decodert_requests_total{endpoint="/v1/completions",status="499"}') < 3:
                assert time.time() < deadline, httpx.get(f"{url}/metrics").text
                time.sleep(0.05)
        finally:
            logger.removeHandler(handler)
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200
    messages = [r.getMessage() for r in lines]
    assert len(messages) == 3 and all("closed the connection before its request body arrived" in m for m in messages)
    assert not any(r.exc_info for r in lines) and all("\n" not in m for m in messages), messages


def test_incomplete_headers_are_closed_after_the_client_timeout(llm):
    """20 slow-loris connections (headers never finished, or nothing sent) are all closed within the timeout;
    the server answers others meanwhile and afterwards."""
    with running(llm, client_timeout_s=1.0) as (url, _):
        socks = []
        for i in range(20):
            s = socket.create_connection(("127.0.0.1", _port(url)), timeout=10)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            socks.append(s)
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=10).status_code == 200
        t0 = time.monotonic()
        for s in socks:
            if s.fileno() % 3 == 0:
                s.sendall(b"a")  # a trickle of header bytes does not extend the deadline
        for s in socks:  # closed (EOF), well before the sockets' 10 s timeout; httptools first answers a
            data = b""  # lone "a" (no request line) with a 400, h11 waits for more: either way the server closes
            while chunk := s.recv(4096):
                data += chunk
            assert data == b"" or data.startswith(b"HTTP/1.1 400 "), data[:80]
            s.close()
        assert time.monotonic() - t0 < 5
        with httpx.Client(base_url=url) as h:  # keep-alive: the header deadline restarts after every response
            for _ in range(3):
                assert h.post("/v1/completions", json=BODY).status_code == 200
                time.sleep(0.6)


def test_schemas_that_fail_at_the_first_step_are_a_400(llm):
    deep = '{"type": "array", "items": ' * 2000 + "{}" + "}" * 2000
    with running(llm) as (url, _):
        for schema in ({"$ref": "#"}, deep):
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            r = httpx.post(f"{url}/v1/completions", json={**BODY, "response_format": fmt})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "response_format" and "\n" not in err["message"], r.text
        assert "nested too deeply" in err["message"]
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200


def test_a_request_that_can_never_fit_is_a_400_not_a_429(llm):
    with running(llm, max_queue=1) as (url, app):  # 4 slots + 1 queued: 5 generations at a time
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "n": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-queue 1" in r.text, r.text
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "prompt": ["a", "b", "c"], "n": 2})
        assert r.status_code == 400 and "6 generations" in r.text, r.text
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "prompt": ["a"] * 5})
        assert r.status_code == 200 and len(r.json()["choices"]) == 5
    with running(llm) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "prompt": ["a"] * 5, "n": 4})  # MAX_CHOICES is 16
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "at most 16" in r.text, r.text


def test_an_unknown_model_is_a_404_model_not_found(llm):
    openai = pytest.importorskip("openai")
    with running(llm) as (url, _):
        for path, body in (("/v1/completions", BODY), ("/v1/chat/completions",
                                                       {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(url + path, json={**body, "model": "gpt-4"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="a", max_tokens=1)


def test_an_empty_api_key_is_refused_from_the_flag_and_the_environment(tmp_path, monkeypatch, capsys):
    from decodert.cli import main

    errors = []
    for args, env in (([], ""), ([], "  "), (["--api-key", ""], None)):
        if env is None:
            monkeypatch.delenv("DECODERT_API_KEY", raising=False)
        else:
            monkeypatch.setenv("DECODERT_API_KEY", env)
        assert main(["serve", str(tmp_path), *args]) == 2
        errors.append(capsys.readouterr().err)
    assert len(set(errors)) == 1 and errors[0].startswith("decodert: error: --api-key is empty"), errors
    assert len(errors[0].strip().splitlines()) == 1


def test_the_cli_checks_hosts_and_times_headers(tmp_path):
    import signal

    from serve_helpers import export_tiny, start_cli

    proc, url = start_cli(export_tiny(tmp_path, max_batch=2, max_seq=64), "--model-name", "tiny", "--client-timeout", "1",
                          "--allowed-hosts", "api.example")
    try:
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            t0 = time.monotonic()
            assert s.recv(100) == b"" and time.monotonic() - t0 < 5
        assert httpx.post(f"{url}/v1/completions", json=BODY, headers={"Host": "api.example"}).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=BODY, headers={"Host": "evil.example"}).status_code == 421
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
