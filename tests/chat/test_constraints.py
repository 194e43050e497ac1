"""Structured output (runtime/constraints.py) in the loop, over the fake backend's random model.

A random model writes anything the mask lets through, so these tests exercise the constraint
machinery hard and fast: every output must still match its schema / regex / grammar. The real
model (SmolLM2) is in tests/chat/test_constraints_smollm2.py.
"""

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from fake_backend import make_llm  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime import constraints, mask_overlap  # noqa: E402
from decodert.runtime.constraints import Constraint  # noqa: E402
from decodert.runtime.llm import Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

EOS = 0


@pytest.fixture(scope="module")
def llm():
    return make_llm(eos=[EOS], max_seq=256, max_batch=4)


def _valid(schema, text):
    jsonschema.validate(json.loads(text), schema)  # raises on a parse or validation failure
    return True


def test_every_schema_holds_for_a_random_model_greedy_and_sampled(llm):
    reqs = [{"prompt": f"hello {i}", "json_schema": s, "max_new_tokens": 200, "temperature": t, "seed": i}
            for t in (0.0, 1.0) for i, (_, s) in enumerate(SCHEMAS)]
    results = llm.generate_many(reqs)
    for r, req in zip(results, reqs):
        assert r.finish_reason == "stop", (req, r.text)
        assert _valid(req["json_schema"], r.text), r.text


def test_greedy_constrained_rows_ask_for_logits_and_follow_the_mask(llm):
    llm.backend.calls.clear()
    r = llm.generate("hello", regex=r"[0-9]{3}-[0-9]{4}", max_new_tokens=20)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.text) and r.finish_reason == "stop"
    assert all(want for kind, _, want in llm.backend.calls if kind != "move"), "a constrained row needs logits"
    plain = llm.generate("hello", max_new_tokens=8)
    assert not re.fullmatch(r"[0-9-]*", plain.text), "the unconstrained model writes something else"


def test_lark_grammar(llm):
    grammar = 'start: pair ("," pair)*\npair: KEY "=" VALUE\nKEY: /[a-z]{1,6}/\nVALUE: /[0-9]{1,3}/'
    for seed in range(3):
        r = llm.generate("the quick", grammar=grammar, max_new_tokens=60, temperature=1.0, seed=seed)
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "stop":
            assert re.fullmatch(r"[a-z]{1,6}=[0-9]{1,3}(,[a-z]{1,6}=[0-9]{1,3})*", r.text), r.text
        else:  # the grammar never ends by itself: a cut output is a prefix of a valid one
            assert re.fullmatch(r"([a-z]{1,6}=[0-9]{1,3},)*[a-z]{0,6}(=[0-9]{0,3})?", r.text), r.text


def test_batch_rows_with_different_constraints_equal_their_solo_runs(llm):
    schema_a, schema_b = dict(SCHEMAS)["nested_objects"], dict(SCHEMAS)["int_array_bounds"]
    reqs = [Request("hello", SamplingParams(max_new_tokens=200), constraint=Constraint.of(json_schema=schema_a)),
            Request("the quick", SamplingParams(max_new_tokens=30)),
            Request("a", SamplingParams(max_new_tokens=30, temperature=0.8, seed=3), constraint=Constraint.of(regex=r"[a-z]{2,5}!")),
            {"prompt": "lazy dog", "json_schema": schema_b, "max_new_tokens": 80}]
    batched = llm.generate_many(reqs)
    solo = [llm.generate("hello", json_schema=schema_a, max_new_tokens=200), llm.generate("the quick", max_new_tokens=30),
            llm.generate("a", regex=r"[a-z]{2,5}!", max_new_tokens=30, temperature=0.8, seed=3),
            llm.generate("lazy dog", json_schema=schema_b, max_new_tokens=80)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
    assert _valid(schema_a, batched[0].text) and _valid(schema_b, batched[3].text)
    assert re.fullmatch(r"[a-z]{2,5}!", batched[2].text)


def test_max_new_tokens_cut_gives_length_and_a_valid_prefix(llm):
    schema = dict(SCHEMAS)["nested_objects"]
    r = llm.generate("hello", json_schema=schema, max_new_tokens=4)
    assert r.finish_reason == "length" and len(r.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)
    guide = llm.guidance.guide(Constraint.of(json_schema=schema))
    assert guide.check(r.token_ids) == 4 and not guide.finished


def test_eos_only_when_the_grammar_allows_it(llm):
    # "yes" or "yes please": after "yes" the grammar may end, so eos is allowed there and only there
    seen_eos = False
    for seed in range(8):
        r = llm.generate("hello", regex=r"(yes|no)( please)?", max_new_tokens=10, temperature=1.5, seed=seed)
        assert r.finish_reason == "stop" and re.fullmatch(r"(yes|no)( please)?", r.text), r.text
        seen_eos |= r.token_ids[-1] == EOS
    assert seen_eos, "a random model should pick eos at least once when it is allowed"


def test_stop_string_still_ends_the_output(llm):
    r = llm.generate("hello", json_schema={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                     stop=['"'], max_new_tokens=30)
    assert r.finish_reason == "stop" and r.text.startswith("{") and '"' not in r.text


def test_stream_and_chat_apis(llm):
    schema = dict(SCHEMAS)["flat_required"]
    stream = llm.stream("hello", json_schema=schema, max_new_tokens=60)
    text = "".join(stream)
    assert text == stream.result.text and _valid(schema, text)
    llm_chat = make_llm(eos=[EOS], max_seq=256, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    msgs = [{"role": "user", "content": "hello"}]
    assert _valid(schema, llm_chat.chat(msgs, json_schema=json.dumps(schema), max_new_tokens=60).text)
    stream = llm_chat.stream_chat(msgs, regex=r"[0-9]{4}", max_new_tokens=10)
    assert re.fullmatch(r"[0-9]{4}", "".join(stream))


def test_overlapped_masks_give_the_same_tokens(llm, monkeypatch):
    reqs = [{"prompt": f"hello {i}", "json_schema": s, "max_new_tokens": 120, "temperature": 0.7, "seed": i}
            for i, (_, s) in enumerate(SCHEMAS[:6])]
    threads = []
    real = mask_overlap.compute_masks

    def spy(guides):
        threads.append(threading.current_thread().name)
        real(guides)

    monkeypatch.setattr(mask_overlap, "compute_masks", spy)
    auto = llm.generate_many(reqs)  # default rule: the first (unknown-cost) masks overlap, cheap ones run inline
    assert 1 <= len(threads) < sum(len(r.token_ids) for r in auto) / 4
    threads.clear()
    monkeypatch.setattr(mask_overlap, "OVERLAP_MIN_S", 0.0)  # overlap every step, however cheap
    overlapped = llm.generate_many(reqs)
    assert threads and all(t.startswith("decodert-masks") for t in threads), "masks must be made on the worker"
    monkeypatch.setattr(mask_overlap, "OVERLAP", False)
    inline = llm.generate_many(reqs)
    assert [r.token_ids for r in overlapped] == [r.token_ids for r in inline] == [r.token_ids for r in auto]


def test_draft_checks_for_speculative_decoding(llm):
    guide = llm.guidance.guide(Constraint.of(regex=r"[0-9]{3}-[0-9]{4}"))
    good = llm.tokenizer.encode("123-4567", add_special_tokens=False).ids
    bad = llm.tokenizer.encode("12a", add_special_tokens=False).ids
    assert guide.check(good) == len(good)
    assert guide.check(good[:1] + bad) < 1 + len(bad)  # the run is cut at the first rejected token
    guide.advance_many(good[:2])
    before = guide.allowed().copy()
    guide.advance_many(good[2:])
    assert guide.finished
    guide.rollback(len(good) - 2)
    assert not guide.finished and np.array_equal(guide.allowed(), before)
    masks = guide.draft_masks(good[2:])  # [k+1, words]: one mask per verified position
    assert masks.shape[0] == len(good) - 1 and np.array_equal(masks[0], guide.mask)
    for i, t in enumerate(good[2:]):
        assert (int(masks[i][t >> 5]) >> (t & 31)) & 1, "each draft token is allowed by its position's mask"
    guide.advance_many(good[2:])
    assert np.array_equal(masks[-1], (guide.compute_mask(), guide.mask)[1]) and guide.finished


@pytest.mark.parametrize("kwargs, message", [
    ({"regex": "a(b"}, r"^invalid regex: \"a\(b\": unclosed group$"),
    ({"grammar": "start: foo"}, r"^invalid Lark grammar: .*unknown name"),
    ({"grammar": "start: ("}, r"^invalid Lark grammar"),
    ({"json_schema": {"type": "foo"}}, r"^invalid JSON schema: Invalid type"),
    ({"json_schema": {"type": "object", "not": {"type": "string"}}}, r"^unsupported JSON schema: .*\"not\""),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, r"^unsupported JSON schema: .*uniqueItems"),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, r"^unsupported JSON schema: \$ref to https://example.com/s.json"),
    ({"json_schema": {"type": "string", "format": "weird"}}, r"^unsupported JSON schema: Unknown format"),
    ({"json_schema": "{bad"}, r"^json_schema is not valid JSON"),
    ({"json_schema": {"$ref": "#"}}, r"^invalid JSON schema: NoExtensionBias"),  # only its first mask failed
    ({"json_schema": '{"items": ' * 2000 + "{}" + "}" * 2000}, r"^json_schema is nested too deeply"),
    ({"json_schema": [1, 2]}, r"^json_schema must be a JSON object"),
    ({"regex": ""}, r"^regex must be a non-empty string"),
    ({"grammar": 3}, r"^grammar must be a non-empty string"),
    ({"regex": "a", "grammar": "start: \"a\""}, r"^give at most one of json_schema, regex or grammar"),
])
def test_bad_constraints_are_one_line_errors(llm, kwargs, message):
    with pytest.raises(DecodertError, match=message) as e:
        llm.generate("hello", max_new_tokens=4, **kwargs)
    assert "\n" not in str(e.value)
    assert llm.slots_in_use == 0


def test_bad_constraint_in_a_batch_names_the_request(llm):
    with pytest.raises(DecodertError, match=r"^request 1: invalid regex"):
        llm.generate_many([{"prompt": "a", "regex": "[0-9]"}, {"prompt": "b", "regex": "(("}])
    with pytest.raises(DecodertError, match=r"^request 0: constraint must be a Constraint"):
        llm.generate_many([Request("a", constraint={"type": "object"})])


def test_constraint_objects_are_checked():
    for kind, text in (("yaml", "a: 1"), ("regex", ""), ("grammar", None)):
        with pytest.raises(DecodertError, match="constraint"):
            Constraint(kind, text)
    assert Constraint.of() is None and hash(Constraint.of(regex="a")) == hash(Constraint("regex", "a"))


def test_response_format():
    assert Constraint.from_response_format(None) is None
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint("json_schema", '{"type": "object"}')
    c = Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"},
                                                                                 "strict": False}})
    assert c == Constraint("json_schema", '{"type": "integer"}')
    c = Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": {  # strict by default
        "type": "object", "properties": {"a": {"type": "object", "properties": {}}}}}})
    assert json.loads(c.text) == {"type": "object", "properties": {"a": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}},
                                  "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}}
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}}, "json"):
        with pytest.raises(DecodertError):
            Constraint.from_response_format(bad)


def test_model_without_eos_is_refused():
    with pytest.raises(DecodertError, match="eos"):
        make_llm(eos=[]).generate("hello", regex="[a-z]", max_new_tokens=2)


# -- CLI: --json-schema FILE, --regex R, --grammar FILE ------------------------------------------
def _cli_llm(monkeypatch, llm):
    from decodert.cli import common

    monkeypatch.setattr(common, "load", lambda path, backend, verify="fast", draft=None, placement="auto": llm)


def test_cli_flags(llm, monkeypatch, capsys, tmp_path):
    from decodert.cli import main

    _cli_llm(monkeypatch, llm)
    schema = dict(SCHEMAS)["array_of_objects"]
    (tmp_path / "s.json").write_text(json.dumps(schema))
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--json-schema", str(tmp_path / "s.json"),
                 "--max-new-tokens", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and _valid(schema, out["text"])
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--regex", "[0-9]{2}:[0-9]{2}", "--no-stats"]) == 0
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}\n", capsys.readouterr().out)
    (tmp_path / "g.lark").write_text('start: "ok" | "no"\n')
    import decodert.export.prepare

    monkeypatch.setattr(decodert.export.prepare, "prepare_model", lambda model, **kw: tmp_path)
    assert main(["run", str(tmp_path), "--prompt", "hi", "--raw", "--grammar", str(tmp_path / "g.lark"), "--no-stats"]) == 0
    assert capsys.readouterr().out in ("ok\n", "no\n")


def test_cli_chat_answers_follow_the_schema(llm, monkeypatch, tmp_path):
    import argparse
    import io

    from decodert.cli.chat import chat_loop

    llm_chat = make_llm(eos=[EOS], max_seq=256, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    schema = {**dict(SCHEMAS)["flat_required"], "x-guidance": {"whitespace_flexible": False}}  # compact: one line per answer
    (tmp_path / "s.json").write_text(json.dumps(schema))
    from decodert.cli import build_parser

    args = build_parser().parse_args(["chat", str(tmp_path), "--json-schema", str(tmp_path / "s.json"), "--greedy",
                                      "--max-new-tokens", "100", "--no-stats"])
    assert isinstance(args, argparse.Namespace)
    lines = iter(["hello", "the quick"])
    out = io.StringIO()

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert chat_loop(llm_chat, args, read=read, out=out) == 0
    answers = [x for x in out.getvalue().splitlines() if x.strip()]
    assert len(answers) == 2 and all(_valid(schema, a) and " " not in a.split('"name":"')[0] for a in answers), answers


def test_cli_bad_constraint_flags(llm, monkeypatch, capsys, tmp_path):
    from decodert.cli import main

    _cli_llm(monkeypatch, llm)
    (tmp_path / "bad.json").write_text("{not json")
    for flags, message in ((["--json-schema", str(tmp_path / "missing.json")], "cannot read --json-schema"),
                           (["--json-schema", str(tmp_path / "bad.json")], "json_schema is not valid JSON"),
                           (["--regex", "(("], "invalid regex"),
                           (["--grammar", str(tmp_path / "bad.json")], "invalid Lark grammar")):
        assert main(["generate", str(tmp_path), "--prompt", "hi", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decodert: error: ") and message in err and err.count("\n") == 1, err  # names the flag too
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path), "--prompt", "hi", "--regex", "a", "--grammar", str(tmp_path / "bad.json")])


def test_speculative_decoding_keeps_the_constraint(llm, monkeypatch):
    reqs = [(f"hello {i}", s) for i, (_, s) in enumerate(SCHEMAS[:8])]
    plain = [llm.generate(p, json_schema=s, max_new_tokens=200) for p, s in reqs]
    cut = []
    real = constraints.Guide.check
    monkeypatch.setattr(constraints.Guide, "check", lambda g, toks: cut.append((len(toks), n := real(g, toks))) or n)
    llm.backend.calls.clear()
    spec = [llm.generate(p, json_schema=s, max_new_tokens=200, speculative="ngram") for p, s in reqs]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain], "greedy: token-for-token plain decoding"
    assert any(kind == "verify" for kind, _, _ in llm.backend.calls)
    assert any(kept < drafted for drafted, kept in cut), "some drafts must have been cut by the grammar"
    sampled = llm.generate_many([{"prompt": p, "json_schema": s, "max_new_tokens": 200, "temperature": 1.0, "seed": 5,
                                  "speculative": "ngram"} for p, s in reqs])
    assert all(r.finish_reason == "stop" and _valid(s, r.text) for r, (_, s) in zip(sampled, reqs))


def test_session_turns_follow_their_constraints():
    llm_chat = make_llm(eos=[EOS], max_seq=256, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    session = llm_chat.session()
    schema = dict(SCHEMAS)["flat_required"]
    first = session.chat("hello", json_schema=schema, max_new_tokens=100)
    assert first.finish_reason == "stop" and _valid(schema, first.text)
    second = "".join(session.stream_chat("the quick", regex=r"[0-9]{3}", max_new_tokens=10))
    assert re.fullmatch(r"[0-9]{3}", second)
    free = session.chat("lazy dog", max_new_tokens=5)  # a turn without a constraint is free text again
    assert free.finish_reason == "length"
    assert [m["content"] for m in session.history if m["role"] == "assistant"] == [first.text, second, free.text]
