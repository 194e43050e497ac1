"""gpt-oss's harmony chat format: the template renders; the reply's analysis channel is the reasoning and
its final channel the content, whole and streamed, through LLM.chat and the server."""

from __future__ import annotations


import numpy as np
import pytest

from fake_backend import make_llm, make_tokenizer  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.chat.harmony import HarmonyOutput, markup_decoder  # noqa: E402
from decodert.runtime.chat.output import assemble  # noqa: E402

MARKUP = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# A template in harmony's shape (written for these tests), using what gpt-oss's own template needs from
# the sandbox: strftime_now, namespace, a macro, tojson, raise_exception.
HARMONY = (
    "{%- macro header(role) -%}<|start|>{{ role }}<|message|>{%- endmacro -%}"
    "{{- header('system') }}Current date: {{ strftime_now('%Y-%m-%d') }}\nReasoning: "
    "{{ reasoning_effort | default('medium') }}\n# Valid channels: analysis, commentary, final.<|end|>"
    "{%- set state = namespace(seen=0) -%}"
    "{%- for m in messages -%}{%- set state.seen = state.seen + 1 -%}"
    "{%- if m.role == 'user' -%}{{ header('user') }}{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.x to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{%- else -%}{{ raise_exception('unexpected role ' + m.role) }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
REPLY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there!")
USER = [{"role": "user", "content": "Hi"}]


def harmony_llm(reply: str):
    tok = make_tokenizer()
    tok.add_special_tokens(MARKUP)
    script = tok.encode(reply).ids + [tok.token_to_id("<|return|>")]
    starts: dict[int, int] = {}

    def rule(history: np.ndarray) -> int:
        start = starts.setdefault(int(history[0]), len(history))
        return script[min(len(history) - start, len(script) - 1)]

    return make_llm(tok, eos=[tok.token_to_id("<|return|>")], chat_template=HARMONY, rule=rule, max_seq=1024), tok


def test_markup_survives_decoding_only_for_harmony_templates():
    llm, tok = harmony_llm(REPLY)
    ids = tok.encode("<|channel|>final<|message|>ok<|eos|>").ids
    assert markup_decoder(tok, HARMONY).decode(ids) == "<|channel|>final<|message|>ok"  # other specials skipped
    assert markup_decoder(tok, "{{ messages }}") is tok


def test_chat_returns_final_as_text_and_analysis_as_reasoning():
    llm, _ = harmony_llm(REPLY)
    _, prompt, _ = llm.prepare(USER, chat=True).rendered
    assert prompt.startswith("<|start|>system<|message|>Current date: ") and prompt.endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    got = llm.chat(USER, max_new_tokens=80)
    assert (got.text, got.reasoning, got.finish_reason) == ("Hello there!", "The user greets; answer briefly.", "stop")
    stream = llm.stream_chat(USER, max_new_tokens=80)
    assert "".join(stream) == "Hello there!"
    content, reasoning, _ = assemble(stream.deltas)
    assert (content, reasoning) == ("Hello there!", "The user greets; answer briefly.")


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_splitting_is_the_same_streamed_in_any_pieces(cut):
    whole = HarmonyOutput()
    expect = assemble(whole.feed(REPLY) + whole.finish())
    out = HarmonyOutput()
    deltas = [d for i in range(0, len(REPLY), cut) for d in out.feed(REPLY[i:i + cut])] + out.finish()
    assert assemble(deltas) == expect == ("Hello there!", "The user greets; answer briefly.", [])


def test_replies_without_markup_or_cut_short():
    for text, want in (("Just text.", ("Just text.", None)),
                       ("<|channel|>analysis<|message|>still thinking", (None, "still thinking")),  # max tokens
                       ("<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>B",
                        ("AB", None))):
        out = HarmonyOutput()
        assert assemble(out.feed(text) + out.finish())[:2] == want, text


# -- tool calls (commentary to=functions.NAME) ------------------------------------------------------
# gpt-oss's way of rendering tools, earlier calls and tool results (written for these tests after the shape
# of its template: one call per assistant message, the result addressed from functions.NAME to=assistant)
HARMONY_TOOLS = (
    "<|start|>system<|message|>Reasoning: medium\n# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools -%}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{%- for t in tools %}\n// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;{% endfor %}\n} // namespace functions<|end|>{%- endif -%}"
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}{%- set call = m.tool_calls[0].function -%}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{%- set last.name = call.name -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}{%- if last.name is none -%}{{ raise_exception('a tool result before any call') }}"
    "{%- endif -%}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
CALL_REPLY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
ANSWER = "<|channel|>final<|message|>It is 21 C in Paris."
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("cut", [1, 4, 1000])
@pytest.mark.parametrize("reply", [
    CALL_REPLY,  # the recipient in the channel header
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>',  # first
])
def test_tool_calls_are_read_from_the_commentary_channel(reply, cut):
    out = HarmonyOutput(tools=True)
    deltas = [d for i in range(0, len(reply), cut) for d in out.feed(reply[i:i + cut])] + out.finish()
    content, reasoning, calls = assemble(deltas)
    assert content is None and reasoning == ("Need the weather." if reply == CALL_REPLY else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert calls[0]["id"].startswith("call_")
    cut_short = HarmonyOutput(tools=True)  # the stop token is not in the text: the end of the output ends the call
    assert assemble(cut_short.feed(reply.removesuffix("<|call|>")) + cut_short.finish())[2][0]["function"][
        "arguments"] == '{"city": "Paris"}'
    plain = HarmonyOutput()  # no tools in the request: the message stays content, as before
    assert assemble(plain.feed(reply) + plain.finish())[0] == '{"city": "Paris"}'


def test_two_calls_and_a_preamble():
    reply = ("<|channel|>commentary<|message|>Checking both.<|end|>"
             '<|start|>assistant<|channel|>commentary to=functions.a json<|message|>{"x": 1}<|call|>'
             '<|start|>assistant<|channel|>commentary to=functions.b json<|message|>{}<|call|>')
    out = HarmonyOutput(tools=True)
    content, _, calls = assemble(out.feed(reply) + out.finish())
    assert content == "Checking both." and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [c["function"]["arguments"] for c in calls] == ['{"x": 1}', "{}"] and calls[0]["id"] != calls[1]["id"]


def harmony_loop_llm():
    """A gpt-oss-like model that calls get_weather, and answers once the prompt holds a tool result."""
    tok = make_tokenizer()
    tok.add_special_tokens(MARKUP)
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    call, answer = tok.encode(CALL_REPLY).ids, tok.encode(ANSWER).ids + [stops[0]]
    seen = {"start": 0, "last": -1}

    def rule(history: np.ndarray) -> int:
        if len(history) != seen["last"] + 1:  # a new prompt
            seen["start"] = len(history)
        seen["last"] = len(history)
        prompt = tok.decode(history[: seen["start"]].tolist(), skip_special_tokens=False)
        script = answer if "to=assistant" in prompt else call
        return script[min(len(history) - seen["start"], len(script) - 1)]

    return make_llm(tok, eos=stops, chat_template=HARMONY_TOOLS, rule=rule, max_seq=1024)


def test_chat_returns_tool_calls_and_renders_the_result_back_in_harmony():
    llm = harmony_loop_llm()
    _, prompt, _ = llm.prepare(ASK, chat=True, tools=TOOLS).rendered
    assert "type get_weather = (_: {" in prompt  # the template rendered the tools
    got = llm.chat(ASK, tools=TOOLS, max_new_tokens=120)
    assert (got.text, got.reasoning, got.finish_reason) == ("", "Need the weather.", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    stream = llm.stream_chat(ASK, tools=TOOLS, max_new_tokens=120)
    assert "".join(stream) == "" and assemble(stream.deltas)[2][0]["function"]["name"] == "get_weather"
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": got.tool_calls},
                    {"role": "tool", "tool_call_id": got.tool_calls[0]["id"], "content": "21 C"}]
    _, prompt, _ = llm.prepare(follow, chat=True, tools=TOOLS).rendered
    assert prompt.endswith('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                           '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
                           '<|message|>"21 C"<|end|><|start|>assistant')
    again = llm.chat(follow, tools=TOOLS, max_new_tokens=120)
    assert (again.text, again.tool_calls, again.finish_reason) == ("It is 21 C in Paris.", [], "stop")
    with pytest.raises(DecodertError, match="tool_choice 'required' is not supported for a harmony"):
        llm.chat(ASK, tools=TOOLS, tool_choice="required")


@pytest.mark.parametrize("stream", [False, True])
def test_server_returns_openai_tool_calls(stream):
    openai = pytest.importorskip("openai")
    from serve_helpers import running
    from serve_helpers import reassemble, whole

    with running(harmony_loop_llm()) as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", tools=TOOLS, max_tokens=120, temperature=0)
        ask = c.chat.completions.create(messages=ASK, stream=stream, **kw)
        content, reasoning, calls, finish, ids = reassemble(ask) if stream else whole(ask)
        assert (content, reasoning, calls, finish) == (None, "Need the weather.", [("get_weather", '{"city": "Paris"}')],
                                                       "tool_calls")
        messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": ids[0], "type": "function", "function": {"name": "get_weather", "arguments": calls[0][1]}}]},
            {"role": "tool", "tool_call_id": ids[0], "content": "21 C"}]
        assert whole(c.chat.completions.create(messages=messages, **kw))[:4] == ("It is 21 C in Paris.", None, [], "stop")
