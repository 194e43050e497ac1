"""Tool calls agents can rely on, in the Python API (issues 45 and 46): one call for a named choice, a
repeated call ends the reply, finish_reason "tool_calls" whenever complete calls return, no markup in
the content, calls read inside a reasoning the prompt opened, bare hermes calls, tool messages that
answer each call id, tools that are plain JSON with OpenAI's names.

The models are tests/helpers/fake_backend.py's (scripted replies and the random model under constraints).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from fake_backend import make_llm, scripted_llm
from tool_cases import ADD, CITY, OPENS_THINK, SCHEMAS, TEMPLATE, TOOLS, USER

from decodert.errors import DecodertError, RequestError
from decodert.runtime.chat.output import ChatOutput, assemble
from decodert.runtime.chat.tool_calls import FORMATS
from decodert.runtime.chat.tools import check_tools

NAMED = {"type": "function", "function": {"name": "add"}}
NAMES = frozenset({"get_weather", "add"})


def split(text: str, pieces: int = 0, **kw):
    """hermes ``text`` split whole (pieces=0) or streamed in pieces of that many characters."""
    out = ChatOutput(FORMATS["hermes"], **kw)
    step = pieces or len(text) or 1
    deltas = [d for i in range(0, len(text), step) for d in out.feed(text[i:i + step])] + out.finish()
    content, reasoning, calls = assemble(deltas)
    return content, reasoning, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def calls_of(r) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in r.tool_calls or []]


def test_a_repeated_call_ends_the_reply_whole_and_streamed():
    reply = "\n".join([CITY] * 8) + "\nNever reached."
    llm, script = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)
    r = llm.chat(USER, tools=TOOLS, max_new_tokens=400, temperature=0)
    assert calls_of(r) == [("get_weather", '{"city": "Paris"}')] and r.finish_reason == "tool_calls"
    assert len(r.token_ids) < len(script) // 3  # the second call ended it: no looping to max_new_tokens
    llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)
    stream = llm.stream_chat(USER, tools=TOOLS, max_new_tokens=400, temperature=0)
    assert "".join(stream) == "" and calls_of(stream.result) == calls_of(r)
    assert stream.result.finish_reason == "tool_calls"
    other = CITY.replace("Paris", "Rome")  # different calls stay, in order
    for pieces in (0, 1, 5):
        got = split(f"{CITY}\n{other}\n{CITY}\n{other}", pieces)
        assert got == (None, None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_choice_is_one_call_even_with_parallel_calls_on(stream):
    weather = {"type": "function", "function": {"name": "get_weather"}}
    two = CITY + "\n" + CITY.replace("Paris", "Rome")  # a model that would go on to a second call
    llm, _ = scripted_llm(two, chat_template=TEMPLATE, max_seq=1024)
    kw = dict(tools=TOOLS, tool_choice=weather, parallel_tool_calls=True, max_new_tokens=200, temperature=0)
    if stream:
        s = llm.stream_chat(USER, **kw)
        assert "".join(s) == ""
        r = s.result
    else:
        r = llm.chat(USER, **kw)
    assert calls_of(r) == [("get_weather", '{"city": "Paris"}')] and r.finish_reason == "tool_calls"
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    for seed in range(4):
        r = llm.chat(USER, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=True, max_new_tokens=200, temperature=1.0,
                     seed=seed)
        assert len(r.tool_calls) == 1 and r.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(r.tool_calls[0]["function"]["arguments"]), ADD)


def test_required_calls_report_tool_calls_even_when_the_budget_closed_them():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    turn = llm.prepare(USER, tools=TOOLS, tool_choice="required")
    need = len(llm.guidance.closer.path(llm.guidance.compile(turn.constraint), 4096))
    for budget in (need, need + 2, need + 8):
        for seed in range(3):
            r = llm.chat(USER, tools=TOOLS, tool_choice="required", max_new_tokens=budget, temperature=1.0, seed=seed)
            assert r.tool_calls and r.finish_reason == "tool_calls", (budget, r.finish_reason, r.tool_calls)
            for name, arguments in calls_of(r):
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_call_markup_never_reaches_the_content_when_max_tokens_cuts_a_call(stream):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    for budget in range(1, 12):
        kw = dict(tools=TOOLS, tool_choice="required", max_new_tokens=budget, temperature=0)
        if stream:
            s = llm.stream_chat(USER, **kw)
            content, r = "".join(s), s.result
        else:
            r = llm.chat(USER, **kw)
            content = r.text
        assert content == "" and r.text == "" and r.finish_reason == "length", (budget, content)
        assert all(not c["function"]["arguments"] or c["function"]["name"] for c in r.tool_calls)
    for text in ("<tool_", "<tool_call>", '<tool_call>{"name": "get_w', 'Hi <tool_call>{"na'):
        for pieces in (0, 1, 3):
            assert split(text, pieces)[0] in (None, "Hi "), text
    assert split('<tool_call>{"name": "add", "arguments": {"a": 1', 2) == (None, None, [("add", '{"a": 1')])
    assert split("a <b> c </tool_call> d") == ("a <b> c </tool_call> d", None, [])  # no opening marker: text


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_calls_when_the_generation_prompt_opens_think(choice):
    """Qwen3-Thinking templates end the prompt inside <think>: a call written without closing it (a
    constrained one starts at the reply's first token) is a call, not reasoning."""
    llm, _ = scripted_llm(CITY, chat_template=OPENS_THINK, max_seq=1024)
    assert llm.apply_chat_template(USER).endswith("<think>\n")
    r = llm.chat(USER, tools=TOOLS, tool_choice=choice, max_new_tokens=200, temperature=0)
    assert calls_of(r) == [("get_weather", '{"city": "Paris"}')] and r.finish_reason == "tool_calls"
    assert r.reasoning is None and r.text == ""
    thought = "The user wants Paris. I will call <tool_call> now.\n" + CITY  # a marker in the prose is reasoning
    for pieces in (0, 1, 4):
        assert split(thought, pieces, think=True, in_think=True) == (
            None, "The user wants Paris. I will call <tool_call> now.\n", [("get_weather", '{"city": "Paris"}')])
        assert split("Paris.</think>\n" + CITY, pieces, think=True, in_think=True)[1:] == (
            "Paris.", [("get_weather", '{"city": "Paris"}')])


def test_a_bare_json_call_under_auto_is_a_call_when_it_is_the_whole_reply():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    llm, _ = scripted_llm(" " + bare, chat_template=TEMPLATE, max_seq=1024)
    r = llm.chat(USER, tools=TOOLS, max_new_tokens=200, temperature=0)
    assert (r.text, calls_of(r), r.finish_reason) == ("", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    for pieces in (0, 1, 6):
        assert split(bare, pieces, names=NAMES)[2] == [("get_weather", '{"city": "Paris"}')]
        for text in ('{"name": "weather", "arguments": {}}', bare + " and more", '{"city": "Paris"}', '{"name": "add"}',
                     '[' + bare + ']'):
            assert split(text, pieces, names=NAMES) == (text, None, []), text
        assert split(bare, pieces) == (bare, None, [])  # no declared names (no tools): text


def test_echoed_tool_response_tags_are_removed_from_the_answer():
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    reply = "<tool_response>\nIt is 21 C in Paris.</tool_response>"
    for tools in (TOOLS, None):
        llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)
        r = llm.chat(history, tools=tools, max_new_tokens=200, temperature=0)
        assert (r.text, r.finish_reason) == ("It is 21 C in Paris.", "stop")
        llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)
        assert "".join(llm.stream_chat(history, tools=tools, max_new_tokens=200, temperature=0)) == "It is 21 C in Paris."


@pytest.mark.parametrize("messages, message", [
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "add", "arguments": "{}"}}, {"id": "b", "function": {"name": "add", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "a", "content": "1"}],
     "must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have "
     "response messages: b"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {"name": "add", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "zzz", "content": "1"}], "no pending call has id 'zzz'"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {"name": "add", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "tool", "tool_call_id": "a", "content": "2"}],
     "no pending call has id 'a'"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]}], "needs a string 'id'"),
])
def test_tool_messages_must_answer_each_call_id_once(messages, message):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE)
    with pytest.raises(RequestError, match=message) as e:
        llm.chat(USER + messages, max_new_tokens=2)
    assert e.value.param == "messages" and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["</tool_call>", "<|im_end|>", "get weather", "a" * 65, "naïve"])
def test_function_names_outside_openais_pattern_are_refused(name):
    with pytest.raises(DecodertError, match=r"must match \^\[a-zA-Z0-9_-\]\{1,64\}\$"):
        check_tools([{"type": "function", "function": {"name": name}}])


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": {1, 2}}}}}},
    {"type": "function", "function": {"name": "f", "description": b"bytes"}}])
def test_tools_that_are_not_plain_json_are_a_request_error(tool):
    llm = make_llm(eos=(0,), chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(RequestError, match=r"tools\[0\] must be plain JSON") as e:
        llm.chat(USER, tools=[tool], max_new_tokens=2)
    assert e.value.param == "tools"


TREE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 4},
                                         "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["label", "child"]}
PYDANTIC = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
                              "title": "Loc"}},
            "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"], "title": "Args"}


@pytest.mark.parametrize("params", [TREE, PYDANTIC], ids=["ref-root", "pydantic-defs"])
def test_references_in_tool_parameters_resolve_to_the_parameters(params):
    """``"$ref": "#"`` means the parameters schema, and pydantic's $defs work as they do in response_format."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for seed in range(6):
        r = llm.chat(USER, tools=tools, tool_choice="required", parallel_tool_calls=False, max_new_tokens=160,
                     temperature=1.5, seed=seed)
        (call,) = r.tool_calls
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, params)
    assert llm.chat(USER, json_schema=PYDANTIC, max_new_tokens=60, temperature=1.0, seed=1).text
    value = {"label": "a", "child": {"label": "b", "child": None}} if params is TREE else {"loc": {"city": "Paris"}}
    reply = '<tool_call>{"name": "f", "arguments": ' + json.dumps(value) + "}</tool_call>"
    llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)  # the model's own nested call is allowed as written
    r = llm.chat(USER, tools=tools, tool_choice="required", max_new_tokens=160, temperature=0)
    assert [json.loads(c["function"]["arguments"]) for c in r.tool_calls] == [value]


def test_logprobs_of_tokens_the_budget_forced_agree_with_their_top_logprobs():
    """Greedy: the chosen token is always the top-1 of the distribution reported, forced closing tokens
    included (reported as certain), for a required call and a json_schema closed by their budget."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    for kw in (dict(tools=TOOLS, tool_choice="required"), dict(json_schema=schema)):
        prepared = llm.prepare(USER, **kw)
        need = len(llm.guidance.closer.path(llm.guidance.compile(prepared.constraint), 4096))
        forced = 0
        for budget in (need, need + 4):
            r = llm.chat(USER, max_new_tokens=budget, temperature=0, logprobs=True, top_logprobs=3, **kw)
            assert len(r.logprobs) == len(r.token_ids)
            for e in r.logprobs:
                assert e.top[0] == (e.token_id, e.logprob), (budget, e)
                forced += e.logprob == 0.0 and len(e.top) == 1
        assert forced


def test_generate_many_splits_chat_requests_as_chat_does():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    kw = dict(tools=TOOLS, tool_choice=NAMED, max_new_tokens=120, temperature=1.0, seed=3)
    (many, plain) = llm.generate_many([{"messages": USER, **kw}, {"prompt": "hello", "max_new_tokens": 3}])
    one = llm.chat(USER, **kw)
    assert calls_of(many) == calls_of(one) and many.finish_reason == one.finish_reason == "tool_calls"
    assert many.text == "" and plain.tool_calls is None
