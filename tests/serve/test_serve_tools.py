"""Tool calling, reasoning and strict structured output through a real server on 127.0.0.1, with the
official ``openai`` client: each tool_choice streamed and not, a two-step tool loop, every constrained
call validated with jsonschema, streamed deltas reassembled to the non-streamed result."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from fake_backend import make_llm, scripted_llm
from serve_helpers import reassemble, running, whole
from structured_schemas import SCHEMAS as JSON_SCHEMAS
from decodert.runtime.constraints import Constraint
from tool_cases import OPENS_THINK, SCHEMAS, TEMPLATE, THINKING, TOOLS, USER, tool_loop_llm

openai = pytest.importorskip("openai")
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "It is 21 C in Paris."


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_two_step_tool_loop_with_auto(stream):
    with running(tool_loop_llm(CALL, ANSWER)) as (url, _):
        c = client(url)
        messages = list(USER)
        kw = dict(model="tiny", tools=TOOLS, max_tokens=300, temperature=0)
        if stream:
            content, _, calls, finish, ids = reassemble(c.chat.completions.create(messages=messages, stream=True, **kw))
        else:
            content, _, calls, finish, ids = whole(c.chat.completions.create(messages=messages, **kw))
        assert (content, calls, finish) == (None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
        assert ids[0].startswith("call_")
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": ids[0], "type": "function", "function": {"name": calls[0][0], "arguments": calls[0][1]}}]},
            {"role": "tool", "tool_call_id": ids[0], "content": "21 C"}]
        r = c.chat.completions.create(messages=messages, **kw)
        assert whole(r)[:4] == (ANSWER, None, [], "stop")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_constrained_calls_validate_and_streams_reassemble(choice):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        for seed in range(4):
            kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=1.0,
                      seed=seed, parallel_tool_calls=seed % 2 == 0)
            got = whole(c.chat.completions.create(**kw))
            streamed = reassemble(c.chat.completions.create(stream=True, **kw))
            assert streamed[:4] == got[:4]  # same seed, same tokens: the deltas rebuild the whole reply
            assert got[0] is None and got[2] and got[3] in ("tool_calls", "length")
            for name, arguments in got[2]:
                assert name == "add" or choice == "required"
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_answers_text(stream):
    llm, _ = scripted_llm("Hello there.", chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=50, temperature=0)
        r = client(url).chat.completions.create(stream=stream, **kw)
        got = reassemble(r) if stream else whole(r)
        assert got[:4] == ("Hello there.", None, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split(stream):
    llm, _ = scripted_llm("<think>Warm, probably.</think>Sunny.", chat_template=THINKING + "{# </think> #}", max_seq=1024)
    with running(llm) as (url, _):
        r = client(url).chat.completions.create(model="tiny", messages=USER, max_tokens=60, temperature=0,
                                                stream=stream, extra_body={"chat_template_kwargs": {"x": 1}})
        got = reassemble(r) if stream else whole(r)
        assert got[:4] == ("Sunny.", "Warm, probably.", [], "stop")


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "non-empty string 'name'"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "tool_choice must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "not in tools"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages", "not valid JSON"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools", "either tools or"),
    ({"chat_template_kwargs": {"tools": 1}}, "tools", "cannot set 'tools'"),
    ({"enable_thinking": "yes"}, "enable_thinking", "enable_thinking"),
])
def test_bad_tool_requests_are_400(body, param, message):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": USER, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param and "\n" not in error["message"]


def test_strict_json_schema_refuses_unlisted_keys_and_closes_within_max_tokens():
    """response_format json_schema: strict by default, compact, and it closes within max_tokens whenever a
    completion fits, finish_reason "length" (the fake model's random tokens would otherwise run on)."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    with running(llm) as (url, _):
        c = client(url)
        for seed in range(4):
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": open_schema}}
            r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=1.0, seed=seed,
                                          response_format=fmt)
            value = json.loads(r.choices[0].message.content)
            assert set(value) <= {"a", "b"} and ", " not in r.choices[0].message.content.replace('", "', "")
        for name, schema in JSON_SCHEMAS:
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
            need = len(llm.guidance.closer.path(llm.guidance.compile(Constraint.from_response_format(fmt)), 4096))
            for budget in (need, need + 3):  # the tightest budgets that allow a completion at all
                r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=budget, temperature=1.0,
                                              seed=budget, response_format=fmt)
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
                assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_calls_and_logprobs_together_stream_as_whole():
    """A constrained call with logprobs: the streamed call and the logprob entries (riding on the split
    deltas) equal the whole reply's, one entry per generated token, each <= 0 and its top-1 the chosen one."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
                  logprobs=True, top_logprobs=3)
        r = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(stream=True, **kw))
        streamed = [e for ch in chunks for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
        entries = r.choices[0].logprobs.content
        assert reassemble(chunks)[:4] == whole(r)[:4] and whole(r)[2]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
        assert len(entries) == r.usage.completion_tokens
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob == e.logprob for e in entries)


SPECIAL = {"type": "object", "properties": {"role": {"enum": ["<|user|>", "x"]}}, "required": ["role"]}
PYDANTIC = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}},
            "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"]}
TWO_CALLS = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
    {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}]


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SPECIAL}}], "tool_choice": "required"},
     "tools", "special token '<|user|>'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SPECIAL}}},
     "response_format", "special token '<|user|>'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}], "tool_choice": "required"}, "tools", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "</tool_call>"}}]}, "tools", "must match ^[a-zA-Z0-9_-]{1,64}$"),
    ({"messages": USER + TWO_CALLS + [{"role": "tool", "tool_call_id": "call_a", "content": "3"}]}, "messages",
     "an assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'"),
    ({"messages": USER + TWO_CALLS[:1] + [{"role": "tool", "tool_call_id": "call_a", "content": "3"},
                                          {"role": "tool", "tool_call_id": "call_x", "content": "7"}]},
     "messages", "no pending call has id 'call_x'"),
])
def test_tool_schemas_names_and_results_that_cannot_work_are_one_line_400s(body, param, message):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 20, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param and "\n" not in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_one_call_pydantic_defs_and_no_markup_when_max_tokens_cuts(stream):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    tools = TOOLS + [{"type": "function", "function": {"name": "where", "parameters": PYDANTIC}}]
    with running(llm) as (url, _):
        c = client(url)
        for seed in range(3):
            for name, schema in (("add", SCHEMAS["add"]), ("where", PYDANTIC)):
                r = c.chat.completions.create(model="tiny", messages=USER, tools=tools, max_tokens=200, temperature=1.0,
                                              seed=seed, tool_choice={"type": "function", "function": {"name": name}},
                                              parallel_tool_calls=True, stream=stream)
                content, _, calls, finish, _ = reassemble(r) if stream else whole(r)
                assert content is None and len(calls) == 1 and finish == "tool_calls" and calls[0][0] == name
                jsonschema.validate(json.loads(calls[0][1]), schema)
        for budget in (1, 3, 6, 9):  # too few tokens for any call: cut, and never markup as content
            r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=budget,
                                          temperature=0, stream=stream)
            chunks = list(r) if stream else None
            content, _, calls, finish, _ = reassemble(chunks) if stream else whole(r)
            assert not content and finish == "length", (budget, content)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reply, template, choice, want", [
    ("\n".join([CALL] * 6), TEMPLATE, "auto", (None, None, [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', TEMPLATE, "auto",
     (None, None, [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    (CALL, OPENS_THINK, "required", (None, None, [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    ("Let me see.</think>" + CALL, OPENS_THINK, "auto", (None, "Let me see.", [("get_weather", '{"city": "Paris"}')],
                                                         "tool_calls")),
], ids=["repeated-call", "bare-json", "think-required", "think-auto"])
def test_calls_agents_rely_on_stream_as_whole(stream, reply, template, choice, want):
    llm, _ = scripted_llm(reply, chat_template=template, max_seq=1024)
    with running(llm) as (url, _):
        r = client(url).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice,
                                                max_tokens=300, temperature=0, stream=stream)
        assert (reassemble(r) if stream else whole(r))[:4] == want
