"""Sampling at the edges of every parameter (runtime/decoding/sampling.py): a drawn id is always the argmax
or a token with non-zero probability under an independent float64 reference; never NaN's pick."""


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fake_backend import make_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.decoding.sampling import (GREEDY_EPS, SamplingParams, apply_processors, make_logits_processors,  # noqa: E402
                                       make_sampler)

V = 64
EXTREME_T = [0.0, 1e-300, 1e-45, 1e-6, GREEDY_EPS, 1e-3, 1.0, 1e30, 1e308]
EXTREME_PENALTY = {"repetition_penalty": [1e-300, 1e-30, 1.0, 1e30, 1e300],
                   "frequency_penalty": [-1e308, -1e38, 0.0, 1e38, 1e308],
                   "presence_penalty": [-1e308, -1e38, 0.0, 1e38, 1e308]}


def _reference(logits, history, rep, pres, freq):
    """The penalised scores in float64, written independently of sampling.py ([V])."""
    s = logits.astype(np.float64).copy()
    seen, counts = np.unique(history, return_counts=True)
    with np.errstate(over="ignore", invalid="ignore"):
        s[seen] = np.where(s[seen] < 0, s[seen] * rep, s[seen] / rep)
        s[seen] = s[seen] - (pres + freq * counts)
    return s


def _possible(scores, temperature):
    """Ids with non-zero probability at ``temperature`` (the +inf ones if any, else exp > 0)."""
    finite_or_inf = np.where(np.isnan(scores), -np.inf, scores)
    if np.isposinf(finite_or_inf).any():
        return set(np.flatnonzero(np.isposinf(finite_or_inf)))
    top = finite_or_inf.max()
    with np.errstate(over="ignore", invalid="ignore"):
        z = (finite_or_inf - top) / temperature
    return set(np.flatnonzero(np.exp(z) > 0))


def _check(logits, history, temperature, rep=1.0, pres=0.0, freq=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    procs = make_logits_processors(rep, pres, freq)
    sampler = make_sampler(temperature, top_k, top_p, min_p, np.random.default_rng(seed))
    ids = [int(sampler(apply_processors(procs, history, logits[None, :]))[0]) for _ in range(8)]
    ref = _reference(logits, history, rep, pres, freq)
    argmax = int(np.argmax(np.where(np.isnan(ref), -np.inf, ref)))
    if temperature < GREEDY_EPS:
        assert set(ids) == {argmax} or np.isposinf(ref[ids]).all(), (ids, argmax)
    else:
        assert set(ids) <= _possible(ref, temperature) | {argmax}, (ids, temperature)
    return ids


@pytest.mark.parametrize("temperature", EXTREME_T)
def test_extreme_temperatures(temperature):
    logits = np.random.default_rng(1).normal(0, 5, V).astype(np.float32)
    ids = _check(logits, np.array([3, 4]), temperature)
    if temperature < GREEDY_EPS:
        assert ids == [int(np.argmax(logits))] * 8  # 1e-300 used to overflow to inf/NaN and give id 0
    assert SamplingParams(temperature=temperature).greedy == (temperature < GREEDY_EPS)


@pytest.mark.parametrize("name", list(EXTREME_PENALTY))
@pytest.mark.parametrize("i", range(5))
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_extreme_penalties(name, i, temperature):
    value = EXTREME_PENALTY[name][i]
    logits = np.random.default_rng(i).normal(0, 5, V).astype(np.float32)
    kw = {"rep": 1.0, "pres": 0.0, "freq": 0.0}
    kw[{"repetition_penalty": "rep", "presence_penalty": "pres", "frequency_penalty": "freq"}[name]] = value
    ids = _check(logits, np.array([3, 3, 3, 3, 9]), temperature, **kw)
    assert all(0 <= t < V for t in ids)


@pytest.mark.parametrize("freq", [-1e308, -1e38, 1e308])
def test_extreme_penalties_print_no_numpy_warnings(freq):
    """a score of 1e308 - 0 over T=0.2 used to print 'RuntimeWarning: overflow encountered in divide' on the user's stderr."""
    import warnings

    logits = np.random.default_rng(3).normal(0, 5, V).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ids = _check(logits, np.array([3, 9]), 0.2, freq=freq)
    assert all(0 <= t < V for t in ids)


@pytest.mark.parametrize("top_k,top_p,min_p", [(1, 1.0, 0.0), (V * 10, 1.0, 0.0), (0, 1e-300, 0.0), (0, 1.0, 1.0),
                                               (0, 1.0, 1e-300), (3, 1e-9, 0.999), (0, np.nextafter(1, 0), 0.0)])
def test_extreme_filters(top_k, top_p, min_p):
    logits = np.random.default_rng(2).normal(0, 5, V).astype(np.float32)
    ids = _check(logits, np.array([1]), 1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    if top_k == 1 or top_p <= 1e-9 or min_p >= 0.999:
        assert set(ids) == {int(np.argmax(logits))}


def test_nan_and_inf_logits_are_never_drawn():
    logits = np.zeros(V, np.float32)
    logits[[5, 9]] = np.nan
    logits[7] = 3.0
    for t in (0.0, 0.5, 1e30):
        ids = make_sampler(t, rng=np.random.default_rng(0))(np.tile(logits, (50, 1)))
        assert not set(ids.tolist()) & {5, 9}
    logits[[11, 13]] = np.inf
    assert set(make_sampler(0.8, rng=np.random.default_rng(0))(np.tile(logits, (50, 1))).tolist()) == {11, 13}
    with pytest.raises(DecodertError, match="no token has a finite score"):
        make_sampler(0.5)(np.full((1, V), np.nan, np.float32))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.sampled_from(EXTREME_T) | st.floats(0, 1e6),
       rep=st.sampled_from([1e-300, 1e-5, 1.0, 3.0, 1e300]) | st.floats(1e-300, 1e300),
       pres=st.floats(-1e308, 1e308), freq=st.floats(-1e308, 1e308),
       top_k=st.integers(0, 2 * V), top_p=st.floats(1e-300, 1.0).filter(lambda p: p > 0),
       min_p=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_property_drawn_ids_are_possible(t, rep, pres, freq, top_k, top_p, min_p, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 10, V).astype(np.float32)
    history = rng.integers(0, V, 6)
    procs = make_logits_processors(rep, pres, freq)
    scores = apply_processors(procs, history, logits[None, :])
    try:
        ids = make_sampler(t, top_k, top_p, min_p, rng)(scores)
    except DecodertError:  # every score -inf: a clean refusal is allowed, never a NaN pick
        assert np.isneginf(np.where(np.isnan(scores), -np.inf, scores)).all()
        return
    ref = _reference(logits, history, rep, pres, freq)
    assert int(ids[0]) in _possible(ref, max(t, GREEDY_EPS)) | {int(np.argmax(np.nan_to_num(ref, nan=-np.inf)))}


@pytest.mark.parametrize("kw", [{"temperature": 1e-300}, {"temperature": 1e-45}, {"repetition_penalty": 1e-300},
                                {"frequency_penalty": -1e38}, {"frequency_penalty": -1e308}, {"temperature": 1e30}])
def test_llm_with_extreme_values_is_not_stuck_on_id_0(kw):
    llm = make_llm()
    out = llm.generate("hello world", max_new_tokens=6, seed=1, **kw).token_ids
    greedy = llm.generate("hello world", max_new_tokens=6).token_ids
    assert len(out) == 6 and all(0 <= t < llm.backend.vocab_size for t in out)
    if kw.get("temperature", 1) < GREEDY_EPS:
        assert out == greedy
    assert out != [0] * 6
