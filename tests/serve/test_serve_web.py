"""What browsers and hard-coded clients need from `decodert serve`: CORS (--allowed-origins: preflights answered
before the key check, headers only for allowed origins), model aliases and --accept-any-model with a real
``created``, and the one-line request log that --log-level info turns on."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from fake_backend import make_llm  # noqa: E402
from serve_helpers import export_tiny, running  # noqa: E402
from tool_cases import TEMPLATE  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402

APP = "https://app.example"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    return make_llm(eos=[0], max_seq=256, max_batch=4, chat_template=TEMPLATE)


def preflight(url: str, path: str, origin: str, headers: str = "authorization, content-type", **extra):
    return httpx.options(f"{url}{path}", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": headers, **extra})


def cors_headers(r) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-") or k == "vary"}


def test_a_preflight_from_an_allowed_origin_passes_under_the_api_key(llm):
    with running(llm, api_key="k1", allowed_origins=(APP, "http://localhost:5173")) as (url, _):
        r = preflight(url, "/v1/chat/completions", APP, "authorization, content-type, x-stainless-os")
        assert r.status_code == 204 and r.content == b""
        assert r.headers["access-control-allow-origin"] == APP and r.headers["vary"] == "Origin"
        assert "POST" in r.headers["access-control-allow-methods"]
        allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-api-key", "anthropic-version", "x-stainless-os"} <= allowed
        assert int(r.headers["access-control-max-age"]) > 0
        # the real request, with the key: answered, and readable by the page
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": APP, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
        assert r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": APP})  # no key: a readable 401
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
        # the Anthropic route, its headers
        r = preflight(url, "/v1/messages", "http://localhost:5173/", "x-api-key, anthropic-version, content-type")
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://localhost:5173/"
        # any other origin: a one-line 403 preflight, no CORS headers on anything
        r = preflight(url, "/v1/chat/completions", "https://evil.example")
        assert r.status_code == 403 and not cors_headers(r) and "--allowed-origins" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                       headers={"Origin": "https://evil.example", "Authorization": "Bearer k1"})
        assert r.status_code == 200 and not cors_headers(r)
        # the Host header protection stays, preflight or not
        r = preflight(url, "/v1/chat/completions", APP, Host="evil.example")
        assert r.status_code == 421 and "Host header" in r.json()["error"]["message"]
        # an OPTIONS that is no preflight goes to the app (405), a GET from the origin gets the header
        assert httpx.options(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 405
        r = httpx.get(f"{url}/v1/models", headers={"Origin": APP, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP


def test_any_origin_and_no_origin(llm):
    with running(llm, allowed_origins=("*",)) as (url, _):
        r = preflight(url, "/v1/completions", "https://anything.example")
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*" and "vary" not in r.headers
        assert "access-control-allow-credentials" not in r.headers
    with running(llm) as (url, _):  # the default: no origin is allowed
        r = preflight(url, "/v1/completions", "http://localhost:3000")
        assert r.status_code == 403 and not cors_headers(r)


def test_aliases_and_accepting_any_model(llm):
    with running(llm, model_name="a", aliases=("b", "c"), created=1234) as (url, _):
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["created"]) for m in cards] == [("a", 1234), ("b", 1234), ("c", 1234)]
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "c"})
        assert r.status_code == 200 and r.json()["model"] == "c"
        assert httpx.get(f"{url}/v1/models/b").json()["id"] == "b"
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert r.status_code == 404 and "'a', 'b', 'c'" in r.json()["error"]["message"]
    with running(llm, model_name="a", accept_any_model=True) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert r.status_code == 200 and r.json()["model"] == "gpt-4o"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["a"]
        assert httpx.get(f"{url}/v1/models/claude-x").json()["id"] == "a"


def test_info_logs_one_line_per_request_without_bodies_or_keys(llm):
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append
    with running(llm, api_key="secret-key") as (url, _):
        logger = logging.getLogger("uvicorn.error")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)  # as `decodert serve --log-level info` sets it
        try:
            auth = {"Authorization": "Bearer secret-key"}
            assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth) as r:
                r.read()
            assert httpx.get(f"{url}/v1/models").status_code == 401
            body = {"model": "tiny", "input": CHAT["messages"], "max_output_tokens": CHAT["max_tokens"]}
            assert httpx.post(f"{url}/v1/responses", json=body, headers=auth).status_code == 200
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    messages = [r.getMessage() for r in lines if r.levelno == logging.INFO]
    assert len(messages) == 4, messages
    chat = [m for m in messages if m.startswith("POST /v1/chat/completions 200 prompt_tokens=")]
    assert len(chat) == 2 and all("completion_tokens=3 " in m and m.endswith(" ms") for m in chat), messages
    assert messages[2].startswith("GET /v1/models 401 ") and "tokens" not in messages[2]
    assert messages[3].startswith("POST /v1/responses 200 prompt_tokens=") and " completion_tokens=" in messages[3]
    assert not any("secret-key" in m or "hi" in m.split() for m in messages)


def test_the_cli_flags(tmp_path):
    from decodert.cli import build_parser
    from decodert.cli.serve import options
    from decodert.runtime.llm import LLM
    from decodert.serve.server import make_app

    art = export_tiny(tmp_path, max_batch=2, max_seq=128)

    def parsed(*flags: str):
        return options(build_parser().parse_args(["serve", str(art), *flags]))

    opts = parsed("--served-model-name", "main,alias-1", "--accept-any-model", "--allowed-origins",
                  "https://a.example, http://localhost:5173,*")
    assert (opts.model_name, opts.aliases, opts.accept_any_model) == ("main", ("alias-1",), True)
    assert opts.allowed_origins == ("https://a.example", "http://localhost:5173", "*")
    config = make_app(opts).state.config
    stamp = LLM.load(art).manifest.created
    assert config.created == int(dt.datetime.fromisoformat(stamp).timestamp()) > 1_600_000_000
    assert config.aliases == ("alias-1",) and config.allowed_origins == opts.allowed_origins
    for flags, message in [(("--allowed-origins", "app.example"), "--allowed-origins takes"),
                           (("--allowed-origins", "https://a.example/path"), "--allowed-origins takes"),
                           (("--served-model-name", "a,,b"), "distinct non-empty names"),
                           (("--served-model-name", "a", "--model-name", "b"), "not both")]:
        with pytest.raises(DecodertError, match=message):
            parsed(*flags)
