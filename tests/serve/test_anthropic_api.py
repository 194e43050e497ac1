"""The Anthropic Messages API (serve/protocols/anthropic.py) through a real server on 127.0.0.1, with the official
``anthropic`` SDK: whole and streamed replies, tool_use blocks and a tool_result follow-up, thinking blocks,
stop reasons, usage against count_tokens and the prefix cache, errors in Anthropic's shape; and one real
tool_use round trip on SmolLM2."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from fake_backend import make_llm, scripted_llm
from serve_helpers import running
from tool_cases import SCHEMAS, TEMPLATE, THINKING, tool_loop_llm

anthropic = pytest.importorskip("anthropic")

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "Sunny and 21 C in Paris."
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMAS["get_weather"]},
         {"name": "add", "input_schema": SCHEMAS["add"]}]


def client(url: str, key: str = "none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def blocks(message) -> list[tuple]:
    """A Message's content as comparable tuples: ("text", text) / ("thinking", text) / ("tool_use", name, input)."""
    out = []
    for b in message.content:
        if b.type == "tool_use":
            out.append(("tool_use", b.name, b.input))
        else:
            out.append((b.type, b.thinking if b.type == "thinking" else b.text))
    return out


def streamed(c, **kw):
    """(text from text_stream, the final message) of ``messages.stream``."""
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        return text, s.get_final_message()


def raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith(("event: ", "data: "))]
    names, datas = lines[0::2], lines[1::2]
    out = [(n[7:], json.loads(d[6:])) for n, d in zip(names, datas)]
    assert all(name == data["type"] for name, data in out)
    return out


def test_text_whole_and_streamed_with_usage_and_count_tokens():
    llm, script = scripted_llm("Hello there.", chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        kw = dict(model="tiny", max_tokens=50, messages=USER, system="Be brief.", extra_body={"temperature": 0.0})
        m = c.messages.create(**kw)
        assert blocks(m) == [("text", "Hello there.")] and m.stop_reason == "end_turn" and m.stop_sequence is None
        assert m.id.startswith("msg_") and m.model == "tiny" and m.role == "assistant"
        count = c.messages.count_tokens(model="tiny", messages=USER, system="Be brief.").input_tokens
        rendered = llm.prepare([{"role": "system", "content": "Be brief."}, *USER], chat=True)
        assert count == len(rendered.ids) == m.usage.input_tokens + m.usage.cache_read_input_tokens
        assert m.usage.output_tokens == len(script)
        text, final = streamed(c, **kw)
        assert text == "Hello there." and blocks(final) == blocks(m) and final.stop_reason == "end_turn"
        assert final.usage.output_tokens == m.usage.output_tokens
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count  # (the second may hit the cache)
        body = {**kw, "system": [{"type": "text", "text": "Be brief."}], "temperature": 0.0}
        del body["extra_body"]
        events = [name for name, _ in raw_events(url, body)]
        assert events[:2] == ["message_start", "content_block_start"] and set(events[2:-3]) == {"content_block_delta"}
        assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_reasons_max_tokens_and_stop_sequence():
    llm, _ = scripted_llm("Hello there. Bye now.", chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        m = c.messages.create(model="tiny", max_tokens=3, messages=USER)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
        for make in (lambda **kw: c.messages.create(**kw), lambda **kw: streamed(c, **kw)[1]):
            m = make(model="tiny", max_tokens=50, messages=USER, stop_sequences=["Bye", "there"])
            assert (m.stop_reason, m.stop_sequence, blocks(m)) == ("stop_sequence", "there", [("text", "Hello ")])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_one_valid_tool_use(stream):
    """tool_choice {"type": "tool"}: one constrained call of that tool, its input valid against input_schema;
    streamed and whole replies agree for a seed."""
    llm = make_llm(eos=(0,), chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        for seed, name in enumerate(["add", "get_weather", "add"]):
            kw = dict(model="tiny", max_tokens=200, messages=USER, tools=TOOLS,
                      tool_choice={"type": "tool", "name": name, "disable_parallel_tool_use": True},
                      extra_body={"seed": seed, "temperature": 1.0})  # (this SDK no longer types sampling fields)
            m = streamed(c, **kw)[1] if stream else c.messages.create(**kw)
            uses = [b for b in m.content if b.type == "tool_use"]
            assert m.stop_reason in ("tool_use", "max_tokens") and len(uses) == 1 and uses[0].name == name
            assert uses[0].id.startswith("toolu_")
            if m.stop_reason == "tool_use":
                jsonschema.validate(uses[0].input, SCHEMAS[name])
            if stream:
                assert blocks(m) == blocks(c.messages.create(**kw))


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_then_tool_result_follow_up(stream):
    with running(tool_loop_llm(CALL, ANSWER)) as (url, _):
        c = client(url)
        kw = dict(model="tiny", max_tokens=300, tools=TOOLS, extra_body={"temperature": 0.0})
        first = streamed(c, messages=USER, **kw)[1] if stream else c.messages.create(messages=USER, **kw)
        assert blocks(first) == [("tool_use", "get_weather", {"city": "Paris"})] and first.stop_reason == "tool_use"
        use = first.content[0]
        history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": [{"type": "text", "text": "21 C"}]}]}]
        second = streamed(c, messages=history, **kw)[1] if stream else c.messages.create(messages=history, **kw)
        assert blocks(second) == [("text", ANSWER)] and second.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks(stream):
    llm, _ = scripted_llm("<think>Warm, probably.</think>Sunny.", chat_template=THINKING + "{# </think> #}",
                          max_seq=1024)
    with running(llm) as (url, _):
        c = client(url)
        kw = dict(model="tiny", max_tokens=60, messages=USER, thinking={"type": "enabled", "budget_tokens": 30})
        if stream:
            text, m = streamed(c, **kw)
            assert text == "Sunny."
            names = [(e, d.get("delta", {}).get("type")) for e, d in raw_events(url, kw)]
            assert ("content_block_delta", "thinking_delta") in names and ("content_block_delta", "text_delta") in names
        else:
            m = c.messages.create(**kw)
        assert blocks(m) == [("thinking", "Warm, probably."), ("text", "Sunny.")] and m.stop_reason == "end_turn"
        # thinking disabled renders the template's empty think block (enable_thinking false)
        off = llm.prepare(USER, chat=True, enable_thinking=False)
        assert c.messages.count_tokens(model="tiny", messages=USER, thinking={"type": "disabled"}).input_tokens \
            == len(off.ids)


def test_prefix_cache_hits_are_cache_read_input_tokens():
    llm, _ = scripted_llm("Hello there.", chat_template=TEMPLATE, max_seq=1024, prefix_cache_mb=8)
    long = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, hello world. " * 3}]
    with running(llm) as (url, _):
        c = client(url)
        first = c.messages.create(model="tiny", max_tokens=20, messages=long)
        second = streamed(c, model="tiny", max_tokens=20, messages=long)[1]
        count = c.messages.count_tokens(model="tiny", messages=long).input_tokens
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == count
    assert second.usage.cache_read_input_tokens >= 32  # whole blocks of the same prompt
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count


def test_errors_are_in_anthropics_shape_and_the_key_comes_from_x_api_key():
    llm, _ = scripted_llm("Hi.", chat_template=TEMPLATE, max_seq=1024)
    with running(llm, api_key="k1") as (url, _):
        assert blocks(client(url, "k1").messages.create(model="tiny", max_tokens=9, messages=USER)) == [("text", "Hi.")]
        with pytest.raises(anthropic.AuthenticationError):
            client(url, "wrong").messages.create(model="tiny", max_tokens=9, messages=USER)
        with pytest.raises(anthropic.NotFoundError) as e:
            client(url, "k1").messages.create(model="other", max_tokens=9, messages=USER)
        assert e.value.body["error"]["type"] == "not_found_error" and "'other'" in e.value.body["error"]["message"]
        headers = {"x-api-key": "k1", "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
        r = httpx.post(f"{url}/v1/messages", json={"model": "tiny", "messages": USER}, headers=headers)
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "max_tokens is required"}}
        r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "tiny", "messages": USER})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(f"{url}/v1/messages", headers=headers)
        assert r.status_code == 405 and r.json()["type"] == "error"


IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "block type 'document'"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "--allow-image-urls"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"x": 1}]}]}]},
     "citations are not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool type"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 10}},
     "forces tool use"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "less than max_tokens"),
    ({"temperature": 1.5}, "temperature: must be between 0 and 1"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers: is not supported"),
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, "final assistant message"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
])
def test_unsupported_or_bad_requests_are_one_line_400s(body, message):
    llm, _ = scripted_llm("Hi.", chat_template=TEMPLATE, max_seq=1024)
    with running(llm) as (url, _):
        r = httpx.post(f"{url}/v1/messages", json={"model": "tiny", "max_tokens": 64, "messages": USER, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"] and "\n" not in error["message"]


def test_translation_of_blocks_to_chat_messages():
    """Images become data: URLs, tool results "tool" messages (first), is_error a prefix, thinking is dropped,
    cache_control and metadata change nothing."""
    from decodert.serve.protocols.anthropic import MessagesRequest

    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                          "is_error": True}, {"type": "text", "text": "and?"}]}]})
    req.check()
    chat = req.chat(allow_urls=False)
    got = chat.message_dicts()
    assert got[0] == {"role": "system", "content": "S"}
    assert got[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert got[2] == {"role": "assistant", "content": "calling", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert got[3:] == [{"role": "tool", "content": "Error: boom", "tool_call_id": "t1"},
                       {"role": "user", "content": "and?"}]
    assert chat.enable_thinking is False and chat.max_tokens == 8
    remote = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "?"}]}]})
    assert remote.chat(allow_urls=True).message_dicts()[0]["content"][0] == {
        "type": "image_url", "image_url": {"url": IMAGE["source"]["url"]}}  # fetched under --allow-image-urls


def test_smollm2_tool_use_round_trip(smollm2_gguf, tmp_path_factory):
    """The real model, served: a named tool choice yields one valid get_weather call, and the tool_result
    follow-up is answered (text, or another call) with a stop_reason that matches its blocks."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    art = tmp_path_factory.mktemp("smol-messages") / "art"
    export_model(smollm2_gguf, art, target="ort", dtype="fp32", max_seq=1024, max_batch=2, progress=False)
    with running(LLM.load(art), model_name="smollm2") as (url, _):
        c = client(url)
        kw = dict(model="smollm2", max_tokens=120, tools=TOOLS, extra_body={"temperature": 0.0})
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        one = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}  # Anthropic's "exactly one"
        first = c.messages.create(messages=messages, tool_choice=one, **kw)
        uses = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
        jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": "Sunny, 21 C"}]}]
        text, second = streamed(c, messages=messages, **kw)
        kinds = {b.type for b in second.content}
        assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and kinds <= {"text", "tool_use"}
        if second.stop_reason != "max_tokens":
            assert ("tool_use" in kinds) == (second.stop_reason == "tool_use")
        assert text == "".join(b.text for b in second.content if b.type == "text")
