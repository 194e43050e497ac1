"""Tool calling and reasoning in the Python API: parsers per format, streaming splits, constrained calls.

The models are tests/helpers/fake_backend.py's: ``scripted_llm`` writes a given reply; ``make_llm``'s random
model samples anything the constraint allows, so every constrained call is checked with jsonschema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from fake_backend import make_llm, scripted_llm
from tool_cases import ADD, SCHEMAS, TEMPLATE, THINKING, TOOLS, USER, WEATHER

from decodert.errors import DecodertError
from decodert.runtime.chat.output import ChatOutput, assemble
from decodert.runtime.chat.tool_calls import FORMATS, tool_format
from decodert.runtime.chat.tools import check_tools


def split(fmt: str | None, text: str, think: bool = False, pieces: int = 0):
    """Parse ``text`` whole (pieces=0) or streamed in pieces of that many characters -> (content, reasoning, calls)."""
    out = ChatOutput(FORMATS[fmt] if fmt else None, think=think)
    step = pieces or len(text) or 1
    deltas = [d for i in range(0, len(text), step) for d in out.feed(text[i:i + step])] + out.finish()
    content, reasoning, calls = assemble(deltas)
    return content, reasoning, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("fmt, text, calls", [
    ("hermes", 'Let me look.<tool_call>{"name": "f", "arguments": {"q": "a \\"}\\" b"}}</tool_call>\n'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>', [("f", '{"q": "a \\"}\\" b"}'), ("g", "{}")]),
    ("llama3", ' {"name": "f", "parameters": {"x": [1, {"y": 2}]}}', [("f", '{"x": [1, {"y": 2}]}')]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}', [("f", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": true}}]',
     [("f", '{"a": 1}'), ("g", '{"b": true}')]),
    ("mistral", '[{"name": "f", "arguments": {"a": 1}}]', [("f", '{"a": 1}')]),
    ("phi4", '<|tool_call|>[{"arguments": {"a": 1}, "name": "f"}]<|/tool_call|>', [("f", '{"a": 1}')]),
])
def test_each_format_reads_its_calls_whole_and_streamed(fmt, text, calls):
    whole = split(fmt, text)
    assert whole[2] == calls
    assert whole[0] in (None, "Let me look.")
    for pieces in (1, 3, 7):
        assert split(fmt, text, pieces=pieces) == whole


@pytest.mark.parametrize("fmt, text", [("hermes", "a < b and <tool> is not a call"), ("llama3", '{"answer": 42}'),
                                       ("mistral", "[1, 2, 3] are numbers"), (None, "<tool_call>x</tool_call>")])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    for pieces in (0, 1, 4):
        assert split(fmt, text, pieces=pieces) == (text, None, [])


def test_reasoning_is_split_from_content_whole_and_streamed():
    text = "<think>Paris is in France; <tool_call> is no call here.</think>\n\nIt is sunny."
    for pieces in (0, 1, 5):
        assert split("hermes", text, think=True, pieces=pieces) == (
            "It is sunny.", "Paris is in France; <tool_call> is no call here.", [])
    out = ChatOutput(None, think=True, in_think=True)  # the prompt opened <think>
    assert assemble(out.feed("hmm</think>yes") + out.finish())[:2] == ("yes", "hmm")


@pytest.mark.parametrize("template, name", [
    ("{{ '<tool_call>' }}", "hermes"), ("[AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
    ("Environment: ipython <|python_tag|>", "llama3"), ("<|tool_call|>", "phi4"), ("no tools here", "hermes")])
def test_the_template_chooses_the_parser_and_the_user_can_override(template, name):
    assert tool_format(template).name == name
    assert tool_format(template, "mistral").name == "mistral"
    with pytest.raises(DecodertError, match="unknown tool parser 'xml'"):
        tool_format(template, "xml")


@pytest.mark.parametrize("tools, choice, parallel, message", [
    ("x", None, None, "tools must be a list"),
    ([{"type": "function", "function": {}}], None, None, "needs a non-empty string 'name'"),
    ([{"type": "retrieval"}], None, None, "tools\\[0\\] must be"),
    (TOOLS, "sometimes", None, "tool_choice must be one of"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not in tools"),
    (TOOLS, "auto", "yes", "parallel_tool_calls must be true or false"),
    (None, "required", None, "tool_choice needs tools"),
    (TOOLS + TOOLS[:1], None, None, "unique"),
])
def test_bad_tools_are_one_line_errors(tools, choice, parallel, message):
    with pytest.raises(DecodertError, match=message):
        check_tools(tools, choice, parallel)


@pytest.mark.parametrize("messages, message", [
    ([{"role": "tool", "content": "21 C"}], "needs a string 'tool_call_id'"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not valid JSON"),
    ([{"role": "assistant", "tool_calls": "f()"}], "'tool_calls' must be a list"),
    ([{"role": "user", "tool_calls": []}], "on an assistant message"),
    ([{"role": "assistant", "tool_calls": [{"id": "1"}]}], "tool_calls\\[0\\] must be"),
])
def test_malformed_tool_messages_are_refused(messages, message):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE)
    with pytest.raises(DecodertError, match=message):
        llm.chat(messages, max_new_tokens=2)


def test_tools_and_tool_results_render_into_the_template():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE)
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = llm.apply_chat_template(messages, tools=TOOLS)
    assert '"name": "get_weather"' in text and '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "tool: 21 C" in text
    plain = make_llm(eos=(0,), chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    text = plain.apply_chat_template(messages, tools=TOOLS)  # no tools in the template: a system message says them
    assert text.startswith("system: Functions you may call:")  # the call in the assistant's text, the result as a tool turn
    assert 'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\ntool: 21 C\n' in text
    strict = make_llm(eos=(0,), chat_template=(  # a template that takes user and assistant turns only
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('roles!') }}"
        "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"))
    assert "user: <tool_response>\n21 C\n</tool_response>" in strict.apply_chat_template(messages, tools=TOOLS)


def test_a_scripted_call_is_returned_with_an_id_and_finish_reason_tool_calls():
    reply = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)
    r = llm.chat(USER, tools=TOOLS, max_new_tokens=200, temperature=0)
    assert (r.text, r.finish_reason) == ("Checking.", "tool_calls")
    (call,) = r.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    stream = llm.stream_chat(USER, tools=TOOLS, max_new_tokens=200, temperature=0)
    assert "".join(stream) == "Checking."  # the call's markup never reaches the content
    assert [c["function"] for c in stream.result.tool_calls] == [call["function"]]
    assert stream.result.finish_reason == "tool_calls"
    llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)  # a new prompt length: a new scripted model
    none = llm.chat(USER, tools=TOOLS, tool_choice="none", max_new_tokens=200, temperature=0)
    assert none.tool_calls is None and none.text == reply  # tool_choice "none": text, nothing read


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("parallel", [False, True])
def test_constrained_calls_always_validate(choice, parallel):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    for seed in range(6):
        r = llm.chat(USER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, max_new_tokens=200,
                     temperature=1.0, seed=seed)
        assert r.tool_calls and r.finish_reason in ("tool_calls", "length") and r.text == ""
        assert parallel or len(r.tool_calls) == 1
        for call in r.tool_calls:
            name = call["function"]["name"]
            assert name == "add" or choice == "required"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_auto_constrains_a_call_once_the_model_opens_one():
    reply = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}</tool_call>'
    llm, _ = scripted_llm(reply, chat_template=TEMPLATE, max_seq=1024)
    r = llm.chat(USER, tools=TOOLS, tool_choice="auto", max_new_tokens=200, temperature=0)
    assert r.text == "Sure." and len(r.tool_calls) == 1  # "extra" is refused: only a listed key may follow
    args = json.loads(r.tool_calls[0]["function"]["arguments"])
    assert args["city"] == "Paris" and "extra" not in args
    jsonschema.validate(args, WEATHER)


def test_reasoning_in_chat_stream_and_enable_thinking():
    reply = "<think>It is warm there.</think>Sunny."
    llm, _ = scripted_llm(reply, chat_template=THINKING + "{# </think> #}", max_seq=1024)
    r = llm.chat(USER, max_new_tokens=100, temperature=0)
    assert (r.text, r.reasoning) == ("Sunny.", "It is warm there.")
    stream = llm.stream_chat(USER, max_new_tokens=100, temperature=0)
    assert "".join(stream) == "Sunny." and stream.result.reasoning == "It is warm there."
    assert [d.text for d in stream.deltas if d.kind == "reasoning"]
    assert llm.apply_chat_template(USER, enable_thinking=False).endswith("<think>\n\n</think>")
    assert llm.apply_chat_template(USER, chat_template_kwargs={"enable_thinking": False}).endswith("</think>")
    with pytest.raises(DecodertError, match="chat_template_kwargs cannot set 'tools'"):
        llm.chat(USER, chat_template_kwargs={"tools": []})
    with pytest.raises(DecodertError, match="enable_thinking must be true or false"):
        llm.chat(USER, enable_thinking="no")


def test_tools_and_a_json_schema_together_are_refused():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE)
    with pytest.raises(DecodertError, match="either tools or a structured-output constraint"):
        llm.chat(USER, tools=TOOLS, json_schema={"type": "object"}, max_new_tokens=4)


def test_a_session_carries_tools_and_a_tool_loop():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    session = llm.session()
    r = session.chat("Add 2 and 3", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                     max_new_tokens=120, temperature=1.0, seed=0)
    jsonschema.validate(json.loads(r.tool_calls[0]["function"]["arguments"]), ADD)
    r2 = session.chat({"role": "tool", "tool_call_id": r.tool_calls[0]["id"], "content": "5"}, tools=TOOLS,
                      tool_choice="none", max_new_tokens=4, temperature=0)
    assert r2.tool_calls is None and len(session.history) == 4
