"""Property test of the public API over random Python values for the prompt and each sampling
parameter: only a one-line DecodertError or a correct result passes, and an independent oracle
says which of the two each input must give (valid inputs are never refused)."""

import collections
import math
import os

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from fake_backend import make_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.decoding.generate import GenerationResult  # noqa: E402

LLM_ = make_llm(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
V = LLM_.backend.vocab_size
ROOM = LLM_.max_seq  # a prompt leaves room for one new token: at most max_seq - 1 ids
EXAMPLES = int(os.environ.get("DECODERT_API_FUZZ", "300"))  # default run ~4 s; set it for long random runs

OUTCOMES: collections.Counter = collections.Counter()  # "error" / "correct" per entry point (long runs print it)
ODD = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                st.text(max_size=8), st.binary(max_size=8), st.just(bytearray(b"ab")), st.lists(st.integers(-5, 400), max_size=4),
                st.lists(st.text(max_size=3), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                st.just(float("inf")), st.just(np.int64(3)), st.just(np.float32(0.5)), st.just(object()))
PROMPTS = st.one_of(st.text(max_size=20), st.lists(st.integers(-3, V + 3), max_size=6),
                    st.lists(st.one_of(st.integers(0, V - 1), st.floats(), st.text(max_size=2)), max_size=4),
                    st.lists(st.text(max_size=6), max_size=3), ODD,
                    st.builds(lambda a: np.array(a, dtype=np.int64), st.lists(st.integers(0, V - 1), max_size=4)))
PARAMS = {"max_new_tokens": st.integers(-2, 6), "temperature": st.floats(-1, 1e308), "top_k": st.integers(-2, 2 * V),
          "top_p": st.floats(-0.5, 1.5), "min_p": st.floats(-0.5, 1.5), "repetition_penalty": st.floats(-1, 1e308),
          "presence_penalty": st.floats(), "frequency_penalty": st.floats(), "seed": st.integers(-5, 2**64),
          "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
          "stop_token_ids": st.lists(st.integers(-2, V), max_size=3)}


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_num(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _valid_text(t):
    try:
        t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return 0 < len(LLM_.tokenizer.encode(t, add_special_tokens=False).ids) < ROOM


def _valid_ids(p):
    if isinstance(p, np.ndarray):
        return p.ndim == 1 and 0 < p.size < ROOM and np.issubdtype(p.dtype, np.integer) and 0 <= p.min() and p.max() < V
    return isinstance(p, (list, tuple)) and 0 < len(p) < ROOM and all(_is_int(t) and 0 <= t < V for t in p)


def _valid_prompt(p):
    """Oracle: (is it valid?, how many results) - written from the documented rules, not the code."""
    if isinstance(p, str):
        return _valid_text(p), None
    if _valid_ids(p):
        return True, None
    if isinstance(p, (list, tuple)) and p and all(isinstance(q, (str, list, tuple, np.ndarray)) for q in p):
        return all(_valid_text(q) if isinstance(q, str) else _valid_ids(q) for q in p), len(p)
    return False, None


RULES = {"max_new_tokens": lambda v: _is_int(v) and v >= 1, "temperature": lambda v: _is_num(v) and v >= 0,
         "top_k": lambda v: _is_int(v) and v >= 0, "top_p": lambda v: _is_num(v) and 0 < v <= 1,
         "min_p": lambda v: _is_num(v) and 0 <= v <= 1, "repetition_penalty": lambda v: _is_num(v) and v > 0,
         "presence_penalty": _is_num, "frequency_penalty": _is_num,
         "seed": lambda v: v is None or (_is_int(v) and v >= 0),
         "stop": lambda v: v is None or (isinstance(v, str) and bool(v)) or (isinstance(v, list) and all(isinstance(s, str) and s for s in v)),
         "stop_token_ids": lambda v: v is None or isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)}


def _check_result(r, max_new):
    assert isinstance(r, GenerationResult)
    assert 0 < len(r.token_ids) <= max_new and all(0 <= t < V for t in r.token_ids)


@settings(max_examples=EXAMPLES, deadline=None, derandomize="DECODERT_API_FUZZ" not in os.environ, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prompt=PROMPTS, params=st.fixed_dictionaries({}, optional={**PARAMS, **{k: ODD for k in ("temperature", "stop")}}),
       how=st.sampled_from(["generate", "stream", "generate_many", "chat"]))
def test_public_api_over_random_values(prompt, params, how):
    valid, batch = _valid_prompt(prompt)
    if how == "chat":
        valid, batch = _valid_text(str(prompt)), None  # content may be any value: the template prints it
    if how in ("stream", "generate_many") and batch:
        valid = valid and how == "generate_many"
    valid = valid and all(RULES[k](v) for k, v in params.items())
    max_new = params.get("max_new_tokens", 256)
    try:
        if how == "generate":
            out = LLM_.generate(prompt, **params)
        elif how == "stream":
            s = LLM_.stream(prompt, **params)
            "".join(s)
            out = s.result
        elif how == "chat":
            out = LLM_.chat([{"role": "user", "content": prompt}], **params)
        else:
            items = prompt if batch else [prompt]
            out = LLM_.generate_many([{"prompt": p, **params} for p in items])
    except DecodertError as e:
        assert "\n" not in str(e) and str(e)
        assert not valid, f"a valid input was refused: {e}"
        OUTCOMES[f"{how} error"] += 1
        return
    assert valid, "an invalid input was accepted"
    for r in out if isinstance(out, list) else [out]:
        _check_result(r, max_new)
    assert LLM_.slots_in_use == 0
    OUTCOMES[f"{how} correct"] += 1


def teardown_module():
    if "DECODERT_API_FUZZ" in os.environ:
        print("\napi fuzz outcomes:", dict(sorted(OUTCOMES.items())))
