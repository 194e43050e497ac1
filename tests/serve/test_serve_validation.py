"""Request fields that used to end in a 500 (a traceback inside the handler) and serve flags that used to start a
broken server: each is now one line, a 400 from the server, a RequestError from the API, exit 2 from the CLI."""

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from fake_backend import make_llm  # noqa: E402
from serve_helpers import running  # noqa: E402

from decodert.errors import RequestError  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}"
HUGE_ARGUMENTS = {"[" * 100000: "nested too deeply", '{"a":' * 50000: "nested too deeply",
                  "1" * 10000: "integer of more than 4300 digits", '{"a": ' + "7" * 10000 + "}": "4300 digits"}


@pytest.fixture(scope="module")
def llm():
    return make_llm(eos=(0,), chat_template=TEMPLATE)  # an eos token: structured output can run (its refusals are tested)


@pytest.fixture(scope="module")
def client(llm):
    with running(llm, model_name="tiny") as (url, _app):
        with httpx.Client(base_url=url, timeout=30) as c:
            yield c


def _history(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


def _refused(client, body: dict, needle: str, path: str = "/v1/chat/completions") -> dict:
    r = client.post(path, json={"model": "tiny", "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and needle in err["message"], r.text[:300]
    assert "\n" not in err["message"] and len(err["message"]) < 400
    return err


@pytest.mark.parametrize("arguments", list(HUGE_ARGUMENTS), ids=["brackets", "objects", "digits", "digits-in-object"])
def test_tool_call_arguments_that_python_cannot_read_are_a_400(client, llm, arguments):
    """RecursionError ('[' x 100000, '{"a":' x 50000) and ValueError (10,000 digits) were 500s."""
    needle = HUGE_ARGUMENTS[arguments]
    err = _refused(client, {"messages": _history(arguments)}, needle)
    assert "tool_calls[0].function.arguments" in err["message"]
    with pytest.raises(RequestError, match=needle) as e:  # the API: the same line
        llm.chat(_history(arguments), max_new_tokens=2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["template", "limits", "lim", "messages", "bos_token", "add_generation_prompt"])
def test_chat_template_kwargs_cannot_name_the_render_calls_own_parameters(client, key):
    """'template' was a TypeError ("got multiple values for argument"), a 500."""
    _refused(client, {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {key: "x"}},
             f"chat_template_kwargs cannot set {key!r}")


def test_chat_template_kwargs_that_collide_with_nothing_still_render(client):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "chat_template_kwargs": {"x": 1},
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_logit_bias_key_of_5000_digits_is_a_400(client, path):
    body = {"logit_bias": {"1" * 5000: 1}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    _refused(client, body, "logit_bias keys are token ids", path)


def _png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.mark.parametrize("fps", [1e-300, 0, -1, 1e308, 1e-4, 2000.0, "inf", "nan", "-inf"])
def test_a_video_fps_outside_its_range_is_a_400(client, fps):
    """fps 1e-300 was an OverflowError, a 500; inf/nan arrive as the JSON literals Infinity / NaN."""
    part = {"type": "video_url", "video_url": {"url": [_png()]}, "fps": 0.0}
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    raw = json.dumps(body).replace('"fps": 0.0', f'"fps": {json.dumps(float(fps))}')
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and "fps must be a number between 0.001 and 1000" in err["message"], r.text[:300]
    assert "\n" not in err["message"]


def test_json_nested_past_the_parsers_limit_names_the_limit(client):
    from decodert.serve.protocols.requests import MAX_JSON_DEPTH

    def nested(depth: int) -> bytes:  # the body object is level 1; metadata holds the rest
        inner = depth - 1
        return b'{"model": "tiny", "prompt": "hi", "max_tokens": 1, "metadata": ' + b"[" * inner + b"]" * inner + b"}"

    ok = client.post("/v1/completions", content=nested(MAX_JSON_DEPTH), headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text[:200]
    r = client.post("/v1/completions", content=nested(MAX_JSON_DEPTH + 1), headers={"content-type": "application/json"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message == ("the request body nests arrays and objects more than "
                                                f"{MAX_JSON_DEPTH} levels deep (the server's limit)")


@pytest.mark.parametrize("flag, value", [("--max-images", "-1"), ("--max-image-pixels", "0"), ("--max-image-bytes", "0"),
                                         ("--max-video-frames", "-1"), ("--max-video-pixels", "0"),
                                         ("--drain-timeout", "inf"), ("--drain-timeout", "nan"),
                                         ("--client-timeout", "inf"), ("--client-timeout", "0"),
                                         ("--prefix-cache-mb", "inf"), ("--replicas", "0"),
                                         ("--target-ongoing-requests", "0"), ("--replica-cpus", "nan"),
                                         ("--replica-gpus", "-1"), ("--port", "70000"), ("--max-queue", "-1"),
                                         ("--max-body-bytes", "10")])
def test_every_numeric_serve_flag_is_checked_before_the_server_starts(tmp_path, capsys, flag, value):
    from decodert.cli import main

    assert main(["serve", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"decodert: error: {flag} must be") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["</tool_call>", "<|eos|>", "get weather", "x" * 65, "é"])
def test_tool_names_outside_openais_rule_are_a_400(client, name):
    """A function named '</tool_call>' came back as content with no call (found by tests/serve/test_fuzz_requests.py)."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    err = _refused(client, {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"},
                   "tools[0].function.name must match ^[a-zA-Z0-9_-]{1,64}$")
    assert err["param"] == "tools"


@pytest.mark.parametrize("schema", [{"const": "<|eos|>"}, {"enum": ["a", "x<|user|>"]},
                                    {"type": "object", "properties": {"<|assistant|>": {"type": "string"}},
                                     "required": ["<|assistant|>"]},
                                    {"anyOf": [{"type": "integer"}, {"const": "<|eos|>"}]}])
def test_schemas_that_spell_a_special_token_are_a_400(client, schema):
    """The grammar cannot write a special token's text: these failed at their first steps (500 'Parser Error')."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    for path, extra in (("/v1/completions", {"prompt": "0"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        err = _refused(client, {"response_format": fmt, **extra}, "this model's special token", path)
        assert err["param"] == "response_format"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": schema},
                                                                           "required": ["a"]}}}]
    err = _refused(client, {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"},
                   "this model's special token")
    assert err["param"] == "tools"
