"""Hypothesis strategies for OpenAI request bodies that are *almost* right: tool definitions, tool-call histories,
JSON schemas (tool parameters and response_format) and sampling fields, each mostly well-formed with hostile
values mixed in; and the oracle every answer is held to (tests/serve/test_fuzz_requests.py).

The bodies reach deep (schema compilation, the grammar, the template, the sampler, the tool-call parser), where
tests/serve/test_fuzz_serve.py's random JSON is refused at the door. The oracle: a 2xx whose body is well-formed
(and right where the request makes it checkable: constrained tool calls and json_schema content validate), or a
4xx whose message is one line; never a 5xx, never a hang (the client's per-request timeout).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# -- values ------------------------------------------------------------------------------------------------------
def mostly(valid: st.SearchStrategy, odd: st.SearchStrategy, one_in: int = 8) -> st.SearchStrategy:
    """``valid``, and ``odd`` about once in ``one_in`` draws (a body with one bad field is refused at the door,
    so each field is rarely bad: most bodies must reach the model)."""
    return st.integers(1, one_in).flatmap(lambda k: odd if k == one_in else valid)  # hypothesis leans to k = 1


HOSTILE_TEXT = st.sampled_from(["", " ", "\ud800", "<tool_call>", "</tool_call>", "<|eos|>", "<think>", "{{ x }}",
                                "{% raw %}", "\\", '"', "é" * 30, "x" * 70, "a\nb", "[" * 300, '{"a":' * 300])
TEXT = mostly(st.text(min_size=1, max_size=12), HOSTILE_TEXT, 4)
NAMES = st.sampled_from(["get_weather", "add", "f", "a-b_c", "x" * 64]) | st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,8}",
                                                                                         fullmatch=True)
ODD_NAMES = st.sampled_from(["", "x" * 65, "</tool_call>", "<|eos|>", "a b", "é", "\ud800", "get weather"])
HUGE_INTS = st.sampled_from([19, -19, 63, 400, 5000]).map(lambda d: -(10**-d) if d < 0 else 10**d)  # built lazily:
# hypothesis writes its strategies' reprs, and Python will not repr an int of over 4300 digits
NUMBERS = st.integers(-5, 100) | st.floats(allow_nan=False, allow_infinity=False, width=32) | HUGE_INTS
ODD = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT | st.lists(st.integers(), max_size=3)


# -- JSON schemas ------------------------------------------------------------------------------------------------
def _leaf() -> st.SearchStrategy[dict]:
    string = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 4), "maxLength": st.integers(0, 12) | st.sampled_from([-1, 10**6]),
        "pattern": st.sampled_from(["^[a-z]+$", "[0-9]{2}", "(", "a|b", ".*"]),
        "enum": st.lists(TEXT, min_size=1, max_size=3), "format": st.sampled_from(["date", "email", "uuid", "nope"])})
    integer = st.fixed_dictionaries({"type": st.just("integer")}, optional={
        "minimum": NUMBERS, "maximum": NUMBERS, "multipleOf": st.sampled_from([2, 0, -1, 0.5])})
    number = st.fixed_dictionaries({"type": st.just("number")}, optional={"minimum": NUMBERS, "maximum": NUMBERS,
                                                                          "exclusiveMaximum": NUMBERS})
    plain = st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, {"const": "x"}, {"const": "<|eos|>"},
                             {"enum": [1, "a", None]}, {"enum": []}, {"type": "strnig"}, {"type": ["string", "null"]},
                             {"type": 5}, {"minimum": "x"}, {"$ref": "#/$defs/missing"}, {"not": {}}])
    return string | integer | number | plain | st.booleans()


def _node(children: st.SearchStrategy) -> st.SearchStrategy:
    props = st.dictionaries(st.sampled_from(["a", "b", "city", "n", "é", "", "x" * 40]), children, max_size=3)
    obj = st.builds(lambda p, req, extra: {"type": "object", "properties": p,
                                           **({"required": req} if req is not None else {}),
                                           **({"additionalProperties": extra} if extra is not None else {})},
                    props, st.none() | st.lists(st.sampled_from(["a", "b", "city", "zzz"]), max_size=3, unique=True),
                    st.none() | st.booleans())
    arr = st.builds(lambda items, lo, hi: {"type": "array", "items": items, **lo, **hi}, children,
                    st.sampled_from([{}, {"minItems": 1}, {"minItems": 5}]),
                    st.sampled_from([{}, {"maxItems": 2}, {"maxItems": 0}]))
    combo = st.builds(lambda k, xs: {k: xs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                      st.lists(children, min_size=1, max_size=3))
    return obj | arr | combo


SCHEMAS = st.recursive(_leaf(), _node, max_leaves=6)


def with_defs(schema: Any) -> dict:
    """A schema that refers to itself through $defs (pydantic's shape), as tools and response_format take."""
    return {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
            "$defs": {"Loc": schema if isinstance(schema, dict) else {"type": "string"}}}


OBJECTS = st.builds(lambda p, req: {"type": "object", "properties": p, **({"required": req} if req else {})},
                    st.dictionaries(st.sampled_from(["a", "b", "city", "n"]), SCHEMAS, max_size=3),
                    st.lists(st.sampled_from(["a", "b", "city"]), max_size=2, unique=True))
PARAMETERS = mostly(OBJECTS, SCHEMAS | SCHEMAS.map(with_defs) | st.sampled_from([{"type": "object"}, [], "x", 5]), 4)


# -- tools, tool choice and tool-call histories -------------------------------------------------------------------
def chosen(tools: Any) -> st.SearchStrategy:
    """A tool_choice for ``tools``: mostly one that fits them (a named choice names one of them), else any."""
    names = [t["function"]["name"] for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    fits = st.sampled_from(["auto", "required", "none"]) | st.none()
    if names:
        fits = fits | st.sampled_from(names).map(lambda n: {"type": "function", "function": {"name": n}})
    return mostly(fits, TOOL_CHOICE, 5)


def _tool(name: str, params: Any, description: Any, kind: Any) -> dict:
    fn: dict[str, Any] = {"name": name}
    if params is not None:
        fn["parameters"] = params
    if description is not None:
        fn["description"] = description
    return {"type": kind, "function": fn}


TOOL = mostly(st.builds(_tool, mostly(NAMES, ODD_NAMES), st.none() | PARAMETERS, st.none() | TEXT,
                        mostly(st.just("function"), st.sampled_from(["fn", None]))), ODD, 12)
TOOLS = st.lists(TOOL, min_size=1, max_size=3)
TOOL_CHOICE = mostly(st.none() | st.sampled_from(["auto", "none", "required"])
                     | st.builds(lambda n: {"type": "function", "function": {"name": n}}, NAMES),
                     st.sampled_from(["any", "", {"type": "function"}, {"function": "f"}, 5]) | ODD_NAMES)

ARGUMENTS = (st.dictionaries(st.sampled_from(["a", "city", "n"]), st.integers(-5, 5) | TEXT, max_size=2).map(json.dumps)
             | st.sampled_from(["", "{}", "[]", "null", "1", "{", '{"a": NaN}', "[" * 100000, '{"a":' * 50000,
                                "1" * 10000, '{"a": ' + "9" * 5000 + "}", '"\\ud800"'])
             | mostly(st.dictionaries(st.sampled_from(["a"]), st.integers(), max_size=1), ODD, 2))


def _call(cid: Any, name: Any, arguments: Any, kind: Any) -> dict:
    return {"id": cid, "type": kind, "function": {"name": name, "arguments": arguments}}


CALL = mostly(st.builds(_call, mostly(st.sampled_from(["c1", "c2"]), ODD), mostly(NAMES, ODD_NAMES | ODD), ARGUMENTS,
                        mostly(st.just("function"), ODD)), ODD, 12)
TURN = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, TEXT),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls}, st.none() | TEXT,
              st.lists(CALL, min_size=1, max_size=2)),
    st.builds(lambda cid, c: {"role": "tool", "tool_call_id": cid, "content": c},
              mostly(st.sampled_from(["c1", "c2"]), ODD), mostly(TEXT, ODD)),
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "developer", "function", "bot"]), TEXT))
HISTORY = st.lists(TURN, min_size=0, max_size=4).map(lambda turns: [{"role": "user", "content": "hi"}] + turns)


# -- sampling fields and response_format --------------------------------------------------------------------------
RESPONSE_FORMAT = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}, {}]),
    st.builds(lambda s, strict: {"type": "json_schema", "json_schema": {"name": "out", "schema": s,
                                                                         **({} if strict is None else {"strict": strict})}},
              SCHEMAS | SCHEMAS.map(with_defs), st.none() | st.booleans()))
LOGIT_BIAS = st.dictionaries(mostly(st.sampled_from(["0", "1", "5", "96", "100000"]),
                                    st.sampled_from(["-1", "a", "1" * 25, "1" * 5000, ""])),
                             mostly(st.floats(-100, 100), st.floats(-150, 150) | st.sampled_from([float("nan"), float("inf")])),
                             max_size=3)
SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": mostly(st.floats(0, 2) | st.sampled_from([1e-300, 2.0]), st.floats(-1, 3) | ODD),
    "top_p": mostly(st.floats(0, 1, exclude_min=True) | st.sampled_from([1e-300, 1.0]), st.floats(-0.5, 1.5) | ODD),
    "top_k": mostly(st.integers(-1, 200), HUGE_INTS | ODD),
    "min_p": mostly(st.floats(0, 1), st.floats(-0.5, 1.5) | ODD),
    "presence_penalty": mostly(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": mostly(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": mostly(st.floats(0.5, 2), st.floats(-1, 5) | st.sampled_from([1e-300, 1e300])),
    "logit_bias": mostly(LOGIT_BIAS, ODD),
    "max_tokens": mostly(st.integers(1, 24), st.integers(-1, 0) | HUGE_INTS | ODD),
    "stop": mostly(st.none() | TEXT | st.lists(TEXT, max_size=3), st.lists(st.just("a"), min_size=17, max_size=17)),
    "n": mostly(st.integers(1, 3), st.sampled_from([0, 17]) | ODD),
    "seed": mostly(st.integers(0, 2**64), st.integers(-3, -1) | ODD),
})
CHAT_ONLY = st.fixed_dictionaries({}, optional={
    "logprobs": mostly(st.booleans(), ODD), "top_logprobs": mostly(st.integers(0, 20), st.integers(-1, 21) | ODD),
    "parallel_tool_calls": mostly(st.booleans(), ODD), "response_format": mostly(RESPONSE_FORMAT, ODD)})
COMPLETION_ONLY = st.fixed_dictionaries({}, optional={"logprobs": mostly(st.integers(0, 5), st.integers(-1, 6) | ODD),
                                                      "response_format": RESPONSE_FORMAT})


# -- the oracle ---------------------------------------------------------------------------------------------------
FINISH = {"stop", "length", "tool_calls"}


def one_line_error(status: int, body: Any) -> None:
    """A 4xx: an OpenAI error object whose message is one line."""
    assert 400 <= status < 500, (status, str(body)[:500])
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
    assert len(err["message"]) < 2000, err["message"][:200]


def sse_chunks(text: str) -> list[dict]:
    """A streamed answer -> its JSON chunks; it must end with [DONE] and carry no error chunk."""
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", text[-300:]
    chunks = [json.loads(d) for d in datas[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    assert not errors, errors
    return chunks


def check_chat_choice(choice: dict) -> None:
    """A chat choice: the assistant's message, a known finish reason, calls with ids, names and argument text."""
    message = choice["message"]
    assert message["role"] == "assistant" and choice["finish_reason"] in FINISH, choice
    assert message["content"] is None or isinstance(message["content"], str)
    for call in message.get("tool_calls") or []:
        assert call["type"] == "function" and isinstance(call["id"], str) and call["id"]
        assert isinstance(call["function"]["name"], str) and isinstance(call["function"]["arguments"], str)
    for entry in (choice.get("logprobs") or {}).get("content") or []:
        assert entry["logprob"] <= 0 and isinstance(entry["token"], str)
