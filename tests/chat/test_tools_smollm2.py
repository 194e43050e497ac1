"""Tool calls and strict formats on the real SmolLM2-135M-Instruct (GGUF fixture), as agents meet them
(issue 46): under its default sampling it called get_weather twice with the same arguments for a
named choice and for ``required`` (a newline after the call forced a second one); a strict email
string ran on to max_tokens."""

import json

import jsonschema
import pytest

from decodert.runtime.closing import strict_schema
from decodert.runtime.constraints import Constraint

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    out = tmp_path_factory.mktemp("smol-tools") / "art"
    export_model(smollm2_gguf, out, target="ort", dtype="fp32", max_seq=512, max_batch=4, progress=False)
    return LLM.load(out)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_one_call_for_a_named_or_required_choice(smol, choice):
    for params in ({}, {"temperature": 0}):  # the model's defaults (temperature 0.2, top_p 0.5), and greedy
        r = smol.chat(ASK, tools=WEATHER, tool_choice=choice, max_new_tokens=120, **params)
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.tool_calls]
        assert calls == [("get_weather", {"city": "Tokyo"})] and r.finish_reason == "tool_calls", calls
        assert r.text == "" and len(r.token_ids) < 120


def test_tool_results_render_as_a_tool_turn(smol):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    prompt = smol.apply_chat_template(messages, tools=WEATHER)
    assert "<|im_start|>tool\n18 C and sunny<|im_end|>" in prompt and "<tool_response>" not in prompt
    r = smol.chat(messages, tools=WEATHER, max_new_tokens=60, temperature=0)
    assert "tool_response>" not in r.text


@pytest.mark.parametrize("fmt", ["email", "uuid", "date-time"])
def test_strict_formats_close_within_small_budgets(smol, fmt):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}, "required": ["a"]}
    given = strict_schema(schema, compact=True)
    need = len(smol.guidance.closer.path(smol.guidance.compile(Constraint.of(json_schema=given)), 4096))
    ask = [{"role": "user", "content": f"Reply with a JSON object whose field a holds an {fmt}."}]
    for budget in sorted({max(need, b) for b in (20, 40, 60)}):
        r = smol.chat(ask, json_schema=given, max_new_tokens=budget)
        jsonschema.validate(json.loads(r.text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        assert len(r.token_ids) <= budget
