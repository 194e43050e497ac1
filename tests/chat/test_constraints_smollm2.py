"""Structured output on the real SmolLM2-135M (GGUF fixture): schemas, regex, Lark, and the token
mask checked against an independent brute-force reference over the whole 49k vocabulary."""

import json
import re

import jsonschema
import numpy as np
import pytest

from structured_schemas import DEFAULT, SCHEMAS  # noqa: E402

from decodert.runtime.constraints import Constraint  # noqa: E402

regex_module = pytest.importorskip("regex")  # partial matching, for the reference mask


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    out = tmp_path_factory.mktemp("smol-structured") / "art"
    export_model(smollm2_gguf, out, target="ort", dtype="fp32", max_seq=512, max_batch=4, progress=False)
    return LLM.load(out)


def _requests(schemas, temperature):
    return [{"messages": [{"role": "user", "content": "Reply with JSON for this schema: " + json.dumps(schema)}],
             "json_schema": schema, "max_new_tokens": 96, "temperature": temperature, "seed": i}
            for i, (_, schema) in enumerate(schemas)]


def _check_schemas(llm, schemas):
    reqs = _requests(schemas, 0.0) + _requests(schemas, 0.9)
    for (name, schema), req, r in zip(schemas * 2, reqs, llm.generate_many(reqs)):
        assert r.finish_reason == "stop", (name, req["temperature"], r.text)
        jsonschema.validate(json.loads(r.text), schema)


def test_default_schemas_greedy_and_sampled(smol):
    _check_schemas(smol, [s for s in SCHEMAS if s[0] in DEFAULT])


@pytest.mark.slow
def test_all_schemas_greedy_and_sampled(smol):
    _check_schemas(smol, SCHEMAS)


def test_regex_and_lark(smol):
    r = smol.generate("The year the Berlin wall fell:", regex=r" (19|20)[0-9]{2}", max_new_tokens=8, temperature=0)
    assert re.fullmatch(r" (19|20)[0-9]{2}", r.text) and r.finish_reason == "stop"
    grammar = 'start: " " answer "."\nanswer: "yes" | "no"'
    r = smol.chat([{"role": "user", "content": "Is Paris in France? Answer yes or no."}], grammar=grammar, max_new_tokens=8, temperature=0)
    assert r.text in (" yes.", " no.") and r.finish_reason == "stop"


def test_unconstrained_row_in_a_constrained_batch_is_unchanged(smol):
    plain = smol.generate("The capital of France is", max_new_tokens=12, temperature=0)
    rows = smol.generate_many([{"prompt": "The capital of France is", "max_new_tokens": 12, "temperature": 0},
                               {"prompt": "A number:", "regex": r" [0-9]{1,3}", "max_new_tokens": 6, "temperature": 0}])
    assert rows[0].token_ids == plain.token_ids
    assert re.fullmatch(r" [0-9]{1,3}", rows[1].text)


def _reference_allowed(texts, prefix, pattern):
    """[V] bool: token t is allowed after ``prefix`` iff prefix + text(t) can still become a match."""
    return np.array([bool(t) and regex_module.fullmatch(pattern, prefix + t, partial=True) is not None for t in texts])


def test_mask_equals_brute_force_reference_over_the_vocabulary(smol):
    pattern = r"[0-9]{3}-[a-z]{2}( ok)?"
    tok, eos = smol.tokenizer, smol.eos_token_ids[0]
    texts = [tok.decode([t], skip_special_tokens=True) for t in range(smol.backend.vocab_size)]  # special tokens -> ""
    guide = smol.guidance.guide(Constraint.of(regex=pattern))
    done = ""
    for prefix in ["", "1", "12", "123", "123-", "123-a", "123-ab", "123-ab o", "123-ab ok"]:
        ids = tok.encode(prefix[len(done):], add_special_tokens=False).ids if prefix != done else []
        guide.advance_many(ids)
        done = prefix
        got, want = guide.allowed(), _reference_allowed(texts, prefix, pattern)
        want[eos] = regex_module.fullmatch(pattern, prefix) is not None  # eos exactly when the text is complete
        assert np.array_equal(got, want), (prefix, np.nonzero(got != want)[0][:10])


def test_a_schema_whose_lexer_overflows_at_the_second_row_fails_before_it_runs(smol):
    """With SmolLM2's vocabulary, this pattern's first mask works once and the next row's fails (llguidance's
    shared lexer is out of budget): compiling computes two, so it is a one-line error up front (a 400), not a step's."""
    from decodert.errors import DecodertError

    with pytest.raises(DecodertError, match=r"^invalid JSON schema: lexer error: too many expressions") as e:
        smol.generate("hi", max_new_tokens=4, json_schema={"type": "string", "pattern": "^a{1000000}$"})
    assert "\n" not in str(e.value) and smol.slots_in_use == 0
