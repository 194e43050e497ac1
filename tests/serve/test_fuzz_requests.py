"""Property: whatever tool definitions, tool-call histories, JSON schemas and sampling fields a client posts, the
server answers a 2xx whose body is well-formed and right where it can be checked (constrained calls and json_schema
content validate against their schemas), or a 4xx with a one-line message: never a 5xx, never a hang.

Strategies: tests/helpers/fuzz_requests.py (mostly well-formed bodies with hostile values mixed in, so that they
reach schema compilation, the grammar, the template, the sampler and the tool-call parser; tests/serve/
test_fuzz_serve.py's random JSON is mostly refused at the door). A real uvicorn server on loopback over the fake
backend (a tiny deterministic model), hermes-style tool template. Default run: 150 derandomised examples (~20 s);
DECODERT_SERVE_PROPERTY=N runs N per test with a random seed.
"""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
import fuzz_requests as fr  # noqa: E402
from fake_backend import make_llm  # noqa: E402
from serve_helpers import running  # noqa: E402
from tool_cases import TEMPLATE  # noqa: E402

LONG = "DECODERT_SERVE_PROPERTY" in os.environ
EXAMPLES = int(os.environ.get("DECODERT_SERVE_PROPERTY", "0")) or None
TIMEOUT = 20.0  # seconds per request: a hang fails here
SETTINGS = dict(deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def server():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024, max_batch=4)
    with running(llm, model_name="tiny", max_queue=16) as (url, _app):
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            yield client


def _post(client, path: str, body: dict):
    try:
        raw = json.dumps(body, allow_nan=True)
    except (ValueError, OverflowError, UnicodeEncodeError):
        return None
    return client.post(path, content=raw.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})


def _answer(resp, body: dict) -> list[dict] | None:
    """The choices of a 2xx (streamed chunks reassembled per choice), or None for a one-line 4xx. A whole answer's
    usage counts at most max_tokens per choice."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        fr.one_line_error(resp.status_code, resp.json())
        return None
    if resp.headers["content-type"].startswith("text/event-stream"):
        choices = _reassemble(fr.sse_chunks(resp.text))
    else:
        answer = resp.json()
        choices = answer["choices"]
        limit = body.get("max_tokens") or 10**6  # None: the rest of the context
        assert answer["usage"]["completion_tokens"] <= limit * len(choices), answer["usage"]
    assert sorted(c["index"] for c in choices) == list(range(body.get("n", 1))), choices
    return choices


def _reassemble(chunks: list[dict]) -> list[dict]:
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            out = choices.setdefault(c["index"], {"index": c["index"], "finish_reason": None, "text": "",
                                                  "message": {"role": "assistant", "content": None}})
            delta = c.get("delta")
            if delta is None:  # completions
                out["text"] += c.get("text") or ""
            else:
                if delta.get("content"):
                    out["message"]["content"] = (out["message"]["content"] or "") + delta["content"]
                for tc in delta.get("tool_calls") or []:
                    calls = out["message"].setdefault("tool_calls", [])
                    while len(calls) <= tc["index"]:
                        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    call = calls[tc["index"]]
                    call["id"] = tc.get("id") or call["id"]
                    call["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                    call["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
    return [choices[k] for k in sorted(choices)]


def _validates(value, schema) -> bool:
    try:
        jsonschema.validators.validator_for(schema)(schema).validate(value)
    except jsonschema.SchemaError:
        return True  # not a schema jsonschema can judge: nothing to hold the answer to
    except jsonschema.ValidationError:
        return False
    return True


def _check_calls(choice: dict, tools: list, tool_choice) -> None:
    """Under "required" or a named choice, a finished answer is calls of the allowed functions whose arguments
    validate against the tool's parameters."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    calls = choice["message"].get("tool_calls") or []
    if not forced or choice["finish_reason"] == "length":
        return
    assert calls, choice
    params = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    for call in calls:
        name = call["function"]["name"]
        if isinstance(tool_choice, dict):
            assert name == tool_choice["function"]["name"], (name, tool_choice)
        assert name in params, (name, list(params))
        args = json.loads(call["function"]["arguments"])
        assert _validates(args, params[name]), (args, params[name])


@settings(max_examples=EXAMPLES or 110, **SETTINGS)
@given(data=st.data(), tools=fr.mostly(fr.TOOLS, st.none(), 6), history=fr.HISTORY, stream=st.booleans(),
       extra=st.fixed_dictionaries({}, optional={"max_tokens": st.integers(1, 96), "temperature": st.sampled_from([0.0, 1.0]),
                                                 "n": st.integers(1, 2),
                                                 "parallel_tool_calls": st.booleans(),
                                                 "logprobs": st.just(True), "seed": st.integers(0, 9)}))
def test_tools_and_tool_call_histories(server, data, tools, history, stream, extra):
    tool_choice = data.draw(fr.chosen(tools), label="tool_choice")
    body = {"model": "tiny", "messages": history, "max_tokens": 64, "stream": stream, **extra}  # room for a whole call
    if tools is not None:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    resp = _post(server, "/v1/chat/completions", body)
    if resp is None:
        return
    choices = _answer(resp, body)
    if choices is None:
        return
    for choice in choices:
        fr.check_chat_choice(choice)
        _check_calls(choice, tools or [], tool_choice)


@settings(max_examples=EXAMPLES or 90, **SETTINGS)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), sampling=fr.SAMPLING, stream=st.booleans(),
       chat=fr.CHAT_ONLY, completion=fr.COMPLETION_ONLY, prompt=fr.TEXT)
def test_sampling_fields_and_response_formats(server, path, sampling, stream, chat, completion, prompt):
    is_chat = path.endswith("chat/completions")
    body = {"model": "tiny", "max_tokens": 12, "stream": stream, **sampling, **(chat if is_chat else completion)}
    body.update({"messages": [{"role": "user", "content": prompt}]} if is_chat else {"prompt": prompt})
    resp = _post(server, path, body)
    if resp is None:
        return
    choices = _answer(resp, body)
    if choices is None:
        return
    fmt = body.get("response_format")
    for choice in choices:
        if is_chat:
            fr.check_chat_choice(choice)
        text = choice["message"]["content"] if is_chat else choice["text"]
        assert choice["finish_reason"] in fr.FINISH and (text is None or isinstance(text, str))
        ended = choice["finish_reason"] == "stop" and not body.get("stop")  # a stop string may cut the JSON (as asked)
        if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema") and ended:
            value = json.loads(text)
            if fmt["type"] == "json_object":
                assert isinstance(value, dict), text
            else:
                assert _validates(value, fmt["json_schema"]["schema"]), (text, fmt)
