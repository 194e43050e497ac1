"""POST /v1/responses through a real server on 127.0.0.1, driven by clients nobody here wrote: the openai SDK
(whole, streamed, ``responses.stream`` and ``responses.parse``), openai-agents with its default model class
(OpenAIResponsesModel) and pydantic-ai's OpenAIResponsesModel. Every body and event is validated by the SDK's
own typed models; stored continuations give the tokens sending the whole history gives."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import numpy as np
import pytest

from fake_backend import make_llm, make_tokenizer
from serve_helpers import running
from tool_cases import SCHEMAS, TEMPLATE, THINKING, TOOLS

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import BaseModel, TypeAdapter  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "It is 21 C in Paris."
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


def tokens(text: str) -> int:
    """What the scripted models generate for ``text``: its tokens and eos."""
    return len(make_tokenizer().encode(text).ids) + 1


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def scripted(reply, template: str = TEMPLATE, **kw):
    """A model that writes ``reply(prompt_text)`` after the prompt's last <|assistant|>, then eos (id 0)."""
    tok = make_tokenizer()
    scripts: dict[str, list[int]] = {}

    def rule(history: np.ndarray) -> int:
        start = int(np.flatnonzero(history == 2)[-1]) + 1
        prompt = tok.decode(history[:start].tolist())
        script = scripts.setdefault(prompt, tok.encode(reply(prompt)).ids + [0])
        return script[min(len(history) - start, len(script) - 1)]

    return make_llm(tok, eos=(0,), chat_template=template, max_seq=1024, rule=rule, **kw)


def weather_model():
    """Calls get_weather until the prompt holds a tool result, then answers."""
    return scripted(lambda prompt: ANSWER if "tool: " in prompt else CALL)


def events_of(stream) -> list:
    """The SDK's parsed events, each validated again by the typed union, in strictly increasing sequence."""
    events = [EVENTS.validate_python(e.model_dump(exclude_unset=True)) for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_whole_and_streamed_agree():
    with running(scripted(lambda _: "Hello there.")) as (url, _):
        c = client(url)
        r = c.responses.create(model="tiny", input="Say hello", instructions="Be brief.", max_output_tokens=40)
        Response.model_validate(r.model_dump())
        assert (r.status, r.output_text, r.instructions, r.incomplete_details) == ("completed", "Hello there.", "Be brief.", None)
        assert [item.type for item in r.output] == ["message"]
        assert r.usage.output_tokens == tokens("Hello there.") and r.usage.input_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens == 0

        events = events_of(c.responses.create(model="tiny", input="Say hello", stream=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
        final = events[-1].response
        assert final.output_text == "Hello there." and final.id == events[0].response.id
        assert final.output[0].id == events[2].item.id and final.usage.output_tokens == tokens("Hello there.")

        with c.responses.stream(model="tiny", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hello"}]}]) as stream:
            for _ in stream:
                pass
            assert stream.get_final_response().output_text == "Hello there."


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(stream):
    with running(weather_model()) as (url, _):
        c = client(url)
        kw = dict(model="tiny", tools=RESPONSES_TOOLS, max_output_tokens=300, temperature=0)
        first = (events_of(c.responses.create(input="Weather in Paris?", stream=True, **kw))[-1].response if stream
                 else c.responses.create(input="Weather in Paris?", **kw))
        (call,) = first.output
        assert (call.type, call.name, json.loads(call.arguments), call.status) == (
            "function_call", "get_weather", {"city": "Paris"}, "completed")
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
        second = c.responses.create(input=history, **kw)
        assert second.output_text == ANSWER and [i.type for i in second.output] == ["message"]


def test_streamed_call_events():
    with running(weather_model()) as (url, _):
        events = events_of(client(url).responses.create(model="tiny", input="Weather?", tools=RESPONSES_TOOLS,
                                                        stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == done.arguments and json.loads(done.arguments) == {"city": "Paris"}
        assert kinds[-2:] == ["response.output_item.done", "response.completed"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_constrained_calls_validate(choice):
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        for seed in range(3):
            r = c.responses.create(model="tiny", input="Add 2 and 3", tools=RESPONSES_TOOLS, tool_choice=choice,
                                   max_output_tokens=200, temperature=1.0, extra_body={"seed": seed},
                                   parallel_tool_calls=seed % 2 == 0)
            calls = [item for item in r.output if item.type == "function_call"]
            assert calls and r.output_text == "" and (len(calls) == 1 or seed % 2 == 0)
            for call in calls if r.status == "completed" else []:
                assert call.name == "add" or choice == "required"
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_sampling_fields_and_tool_choice_none_match_chat_completions():
    """The same turn as chat completions renders and samples: temperature, top_p, seed and max_output_tokens
    reach the sampler, tool_choice "none" leaves the tools out."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        for seed, extra in ((1, {}), (2, {"tools": "none"})):
            tools = dict(tools=RESPONSES_TOOLS, tool_choice="none") if extra else {}
            r = c.responses.create(model="tiny", input="Weather?", instructions="Answer.", temperature=0.9, top_p=0.8,
                                   max_output_tokens=20, extra_body={"seed": seed}, **tools)
            chat_tools = dict(tools=TOOLS, tool_choice="none") if extra else {}
            want = c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Answer."},
                                                                     {"role": "user", "content": "Weather?"}],
                                             temperature=0.9, top_p=0.8, max_tokens=20, seed=seed, **chat_tools)
            assert r.output_text == want.choices[0].message.content
            assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_its_own_item(stream):
    llm = scripted(lambda _: "<think>Warm, probably.</think>Sunny.", THINKING + "{# </think> #}")
    with running(llm) as (url, _):
        c = client(url)
        kw = dict(model="tiny", input="Weather?", reasoning={"effort": "low"}, max_output_tokens=60)
        if stream:
            events = events_of(c.responses.create(stream=True, **kw))
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Warm, probably."
            r = events[-1].response
        else:
            r = c.responses.create(**kw)
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Warm, probably."
        assert r.output_text == "Sunny." and r.reasoning.effort == "low"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        # the reasoning item passed back is accepted (and, as thinking templates do, not rendered)
        again = c.responses.create(model="tiny", input=[{"role": "user", "content": "Weather?"},
                                                        *[i.model_dump(exclude_none=True) for i in r.output],
                                                        {"role": "user", "content": "Sure?"}])
        assert again.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_cut_by_max_output_tokens_is_incomplete(stream):
    with running(scripted(lambda _: "A long answer that goes on and on.")) as (url, _):
        c = client(url)
        if stream:
            events = events_of(c.responses.create(model="tiny", input="Talk", max_output_tokens=3, stream=True))
            assert events[-1].type == "response.incomplete"
            r = events[-1].response
        else:
            r = c.responses.create(model="tiny", input="Talk", max_output_tokens=3)
        assert (r.status, r.incomplete_details.reason, r.output[0].status) == ("incomplete", "max_output_tokens", "incomplete")
        assert r.usage.output_tokens == 3


class Weather(BaseModel):
    city: str
    celsius: int


def test_json_schema_format_and_parse():
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["a"], "additionalProperties": False}
        r = c.responses.create(model="tiny", input="JSON", max_output_tokens=30, temperature=0,
                               text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema"
        parsed = c.responses.parse(model="tiny", input="Weather", text_format=Weather, max_output_tokens=60,
                                   temperature=0)
        assert parsed.status == "incomplete" or isinstance(parsed.output_parsed, Weather)


def test_stored_continuation_equals_the_whole_history():
    """previous_response_id renders the prompt the history would: the same greedy tokens, and its K/V from the
    prefix cache; GET returns a stored response, DELETE drops it, an unknown or evicted id is a 404."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024, prefix_cache_mb=4)
    question = "the quick brown fox jumps over the lazy dog. " * 4
    with running(llm, responses_store=2) as (url, _):
        c = client(url)
        kw = dict(model="tiny", max_output_tokens=24, temperature=0)
        first = c.responses.create(input=question, instructions="Answer.", store=True, **kw)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        follow = [{"role": "user", "content": "hello world, this is a tiny test"}]
        cont = c.responses.create(input=follow, previous_response_id=first.id, instructions="Answer.", store=True, **kw)
        history = [{"role": "user", "content": question}, *[i.model_dump(exclude_none=True) for i in first.output]]
        whole = c.responses.create(input=history + follow, instructions="Answer.", **kw)
        assert cont.output_text == whole.output_text and cont.usage.input_tokens == whole.usage.input_tokens
        assert cont.usage.input_tokens_details.cached_tokens >= 32 and cont.previous_response_id == first.id
        # a third stored response evicts the least recently used (store size 2): `first`
        third = c.responses.create(input="hi", store=True, **kw)
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            c.responses.create(input="more", previous_response_id=first.id, **kw)
        c.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(third.id)
        not_stored = c.responses.create(input="hi", **kw)  # store defaults to false
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(not_stored.id)


@pytest.mark.parametrize("body, param, message", [
    ({"background": True}, "background", "background is not supported"),
    ({"conversation": "conv_1"}, "conversation", "conversation is not supported"),
    ({"truncation": "auto"}, "truncation", "truncation 'auto'"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "not supported"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]",
     "input_file"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id", "call_id"),
    ({"input": []}, "input", "empty"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "text.format type"),
    ({"text": {"verbosity": "high"}}, "text.verbosity", "verbosity"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"max_output_tokens": 5000}, "input", "the context is 1024 tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input", "not valid JSON"),
    ({"tools": RESPONSES_TOOLS, "text": {"format": {"type": "json_object"}}}, "tools", "either tools or"),
    ({"store": True, "previous_response_id": "resp_1"}, "previous_response_id", "no stored response"),
])
def test_what_cannot_be_honoured_is_a_one_line_error(body, param, message):
    with running(scripted(lambda _: "ok")) as (url, _):
        r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", **body})
        assert r.status_code in (400, 404), r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param and "\n" not in error["message"], error
        ok = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", "metadata": {"k": "v"},
                                                     "user": "u", "service_tier": "auto", "prompt_cache_key": "k"})
        assert ok.status_code == 200 and ok.json()["metadata"] == {"k": "v"}


def test_a_client_gone_mid_stream_cancels_the_turn():
    slow = scripted(lambda _: "word " * 100)
    rule = slow.backend.rule
    slow.backend.rule = lambda history: (time.sleep(0.05), rule(history))[1]  # 100 tokens: 5 s unless cancelled
    with running(slow) as (url, app):
        body = {"model": "tiny", "input": "Talk", "stream": True}
        with httpx.stream("POST", f"{url}/v1/responses", json=body) as r:
            lines = r.iter_lines()
            while "output_text.delta" not in next(lines):
                pass
            assert app.state.engine.llm.slots_in_use == 1
        deadline = time.time() + 2
        while app.state.engine.in_flight and time.time() < deadline:
            time.sleep(0.01)
        assert not app.state.engine.in_flight and app.state.engine.llm.slots_in_use == 0


def test_an_image_for_a_text_model_is_a_400():
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    with running(scripted(lambda _: "ok")) as (url, _):
        r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": png}]}]})
        error = r.json()["error"]
        assert r.status_code == 400 and "takes no images" in error["message"] and error["param"] == "input", r.text


def test_a_server_without_a_store_refuses_store():
    with running(scripted(lambda _: "ok"), responses_store=0) as (url, _):
        r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", "store": True})
        assert r.status_code == 400 and "--responses-store 0" in r.json()["error"]["message"]


def test_openai_agents_default_model_runs_a_tool_agent():
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    with running(weather_model()) as (url, _):
        _agent_runs(agents, url, "tiny", agents.ModelSettings())


def _agent_runs(agents, url: str, model: str, settings, streamed: bool = True) -> list[str]:
    """One agent, run whole and streamed: it calls get_weather (checked) and answers from the tool's result."""
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "21 C"

    async def both():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model, c), model_settings=settings)
        outputs = [(await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)).final_output]
        if streamed:
            run = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            async for _ in run.stream_events():
                pass
            outputs.append(run.final_output)
        await c.close()
        return outputs

    outputs = asyncio.run(both())
    assert len(calls) == len(outputs) and all(isinstance(o, str) and o for o in outputs), (calls, outputs)
    return outputs


def test_pydantic_ai_responses_model_runs_a_tool_agent():
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []
    with running(weather_model()) as (url, _):
        model = OpenAIResponsesModel("tiny", provider=OpenAIProvider(base_url=f"{url}/v1", api_key="none"))
        agent = Agent(model, instructions="Answer with the weather tool.")

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """The weather in a city."""
            calls.append(city)
            return "21 C"

        result = agent.run_sync("Weather in Paris?")
        assert calls == ["Paris"] and result.output == ANSWER

        async def streamed() -> str:
            async with agent.run_stream("Weather in Paris?") as run:
                return await run.get_output()

        assert asyncio.run(streamed()) == ANSWER and calls == ["Paris", "Paris"]


def test_langchain_responses_api_gets_tool_calls():
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    with running(weather_model()) as (url, _):
        chat = ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="none", use_responses_api=True, max_retries=0)
        bound = chat.bind_tools(TOOLS[:1])
        message = bound.invoke("Weather in Paris?")
        assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
        chunks = list(bound.stream("Weather in Paris?"))
        total = chunks[0]
        for chunk in chunks[1:]:
            total += chunk
        assert [(c["name"], c["args"]) for c in total.tool_calls] == [("get_weather", {"city": "Paris"})]


# ---- SmolLM2-135M served as the README says (`decodert serve smollm2`; the GGUF fixture's file) -----------------------
@pytest.fixture(scope="module")
def smol_url(smollm2_gguf):
    from serve_helpers import start_cli

    proc, url = start_cli(smollm2_gguf, "--model-name", "smollm2", timeout=600)
    yield url
    proc.terminate()
    assert proc.wait(60) == 0


def test_smollm2_agent_calls_a_real_tool_and_answers(smol_url):
    """openai-agents' default model class against SmolLM2: the first turn must call (tool_choice "required"; the
    agent resets it to auto after the call, as it does by default), the tool runs, the answer uses its result."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=120)
    outputs = _agent_runs(agents, smol_url, "smollm2", settings, streamed=False)
    assert "21" in outputs[0]


def test_smollm2_stored_continuation_reuses_the_cached_prefix(smol_url):
    c = client(smol_url)
    kw = dict(model="smollm2", temperature=0, max_output_tokens=48)
    first = c.responses.create(input="Name three colours of the rainbow.", store=True, **kw)
    follow = [{"role": "user", "content": "And two more?"}]
    cont = c.responses.create(input=follow, previous_response_id=first.id, **kw)
    whole = c.responses.create(input=[{"role": "user", "content": "Name three colours of the rainbow."},
                                      *[i.model_dump(exclude_none=True) for i in first.output], *follow], **kw)
    assert cont.output_text == whole.output_text and cont.usage.input_tokens == whole.usage.input_tokens
    # the first turn's prompt and reply (whole 32-token blocks) come from the prefix cache
    assert cont.usage.input_tokens_details.cached_tokens >= 32, cont.usage


def test_the_store_drops_the_least_recently_used():
    from decodert.serve.api_error import ApiError
    from decodert.serve.protocols.response_store import ResponseStore, Stored

    store = ResponseStore(2)
    for name in "ab":
        store.put(Stored({"id": name}, []))
    store.get("a")  # a is used again: b is now the oldest
    store.put(Stored({"id": "c"}, []))
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(ApiError, match="no stored response 'b'"):
        store.get("b")
    store.delete("a")
    with pytest.raises(ApiError):
        store.delete("a")
    none = ResponseStore(0)
    none.put(Stored({"id": "x"}, []))
    assert len(none) == 0
