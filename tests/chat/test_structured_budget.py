"""Structured output that always parses: with max_new_tokens anywhere from the shortest completion up,
every output of every schema parses and validates (the random fake model would otherwise run into the
budget mid-string), and finish_reason says "length" when the budget closed it early."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from fake_backend import make_llm
from structured_schemas import SCHEMAS

from decodert.runtime.closing import strict_schema
from decodert.runtime.constraints import Constraint


@pytest.fixture(scope="module")
def llm():
    return make_llm(eos=(0,), max_seq=512)


def shortest(llm, schema) -> int:
    """Tokens of the closing path from the start: the smallest budget that allows a complete output."""
    return len(llm.guidance.closer.path(llm.guidance.compile(Constraint.of(json_schema=schema)), 4096))


@pytest.mark.parametrize("name, schema", SCHEMAS, ids=[n for n, _ in SCHEMAS])
def test_every_output_parses_when_the_budget_allows(llm, name, schema):
    for strict in (False, True):
        given = strict_schema(schema, compact=True) if strict else schema
        need = shortest(llm, given)
        for extra in (0, 1, 4, 12):
            for seed in range(2):
                r = llm.generate("x", json_schema=given, max_new_tokens=need + extra, temperature=1.0, seed=seed)
                jsonschema.validate(json.loads(r.text), schema)
                assert len(r.token_ids) <= need + extra
                assert r.finish_reason in ("stop", "length")


def test_a_cut_output_says_length_and_a_budget_too_small_is_not_an_error(llm):
    schema = dict(SCHEMAS)["nested_objects"]
    need = shortest(llm, schema)
    r = llm.generate("x", json_schema=schema, max_new_tokens=need, temperature=1.0, seed=0)
    json.loads(r.text)
    assert r.finish_reason == "length"  # the random model never closes on its own this early
    r = llm.generate("x", json_schema=schema, max_new_tokens=need - 1, temperature=1.0, seed=0)
    assert r.finish_reason == "length" and len(r.token_ids) == need - 1  # no completion fits: it runs to the end


def test_strict_schema_closes_objects_but_not_merged_branches():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "allOf": [{"properties": {"c": {}}}], "$defs": {"d": {"type": "object", "properties": {}}}}
    out = strict_schema(schema)
    assert "additionalProperties" not in out  # allOf beside properties: its keys must stay allowed
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0] and out["$defs"]["d"]["additionalProperties"] is False
    assert strict_schema({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]
    own = {"type": "object", "x-guidance": {"whitespace_flexible": True}}  # a schema's own options win
    assert strict_schema(own, compact=True)["x-guidance"] == {"whitespace_flexible": True}


FORMATS = ("email", "uuid", "date-time", "date", "time", "ipv4", "ipv6", "hostname", "uri", "duration")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_string_format_closes_within_the_budget(llm, fmt):
    """A strict schema with a ``format`` string closes (an email's local part once looped on ``}``, a URI's
    on ``0``: runtime/closing.py escapes a repeated mask), and validates with format checking."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}, "required": ["a"]}
    given = strict_schema(schema, compact=True)
    need = shortest(llm, given)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for budget in sorted({need, need + 3, max(need, 20), max(need, 40), max(need, 60)}):
        for seed in range(2):
            r = llm.generate("x", json_schema=given, max_new_tokens=budget, temperature=1.0, seed=seed)
            value = json.loads(r.text)
            if fmt in ("date-time", "time"):  # llguidance allows RFC 3339's leap second (:60) at any minute
                value["a"] = re.sub(r"(\d\d:\d\d):60", r"\1:59", value["a"])
            jsonschema.validate(value, schema, format_checker=checker)
            assert len(r.token_ids) <= budget
