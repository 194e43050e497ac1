"""Samplers, logits processors and parameter validation (runtime/decoding/sampling.py)."""

import numpy as np
import pytest

from decodert.errors import DecodertError
from decodert.runtime.decoding.sampling import SamplingParams, apply_processors, make_logits_processors, make_sampler


def _logits(probs):
    return np.log(np.asarray(probs, dtype=np.float64))[None, :].astype(np.float32)  # [1, V]


def _draws(sampler, logits, n=4000):
    return np.concatenate([sampler(logits) for _ in range(n)])


def test_greedy_is_argmax_per_row():
    logits = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    out = make_sampler(0.0)(logits)
    assert out.dtype == np.int64 and out.shape == (5,)
    np.testing.assert_array_equal(out, logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = np.zeros((3, 1000), dtype=np.float32)  # uniform: any bug in seeding shows
    s1, s2, s3 = (make_sampler(1.0, rng=np.random.default_rng(seed)) for seed in (7, 7, 8))
    seq1 = np.stack([s1(logits) for _ in range(10)])
    seq2 = np.stack([s2(logits) for _ in range(10)])
    seq3 = np.stack([s3(logits) for _ in range(10)])
    np.testing.assert_array_equal(seq1, seq2)
    assert not np.array_equal(seq1, seq3)


def test_temperature_one_matches_softmax_distribution():
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    sampler = make_sampler(1.0, rng=np.random.default_rng(0))
    freq = np.bincount(_draws(sampler, _logits(probs), 20000), minlength=4) / 20000
    np.testing.assert_allclose(freq, probs, atol=0.015)


def test_temperature_sharpens_and_flattens():
    logits = _logits([0.6, 0.4])
    cold = _draws(make_sampler(0.1, rng=np.random.default_rng(0)), logits, 2000)
    hot = _draws(make_sampler(100.0, rng=np.random.default_rng(0)), logits, 4000)
    assert (cold == 0).mean() > 0.98
    assert 0.45 < (hot == 0).mean() < 0.55


def test_top_k_keeps_only_k_best():
    logits = _logits([0.1, 0.4, 0.05, 0.3, 0.15])
    draws = _draws(make_sampler(5.0, top_k=2, rng=np.random.default_rng(0)), logits)
    assert set(np.unique(draws)) == {1, 3}
    np.testing.assert_array_equal(_draws(make_sampler(5.0, top_k=1, rng=np.random.default_rng(0)), logits, 50), 1)


def test_top_p_keeps_smallest_nucleus():
    logits = _logits([0.05, 0.5, 0.15, 0.3])
    draws = _draws(make_sampler(1.0, top_p=0.7, rng=np.random.default_rng(0)), logits)
    assert set(np.unique(draws)) == {1, 3}  # 0.5 alone < 0.7, 0.5 + 0.3 reaches it
    draws = _draws(make_sampler(1.0, top_p=0.5, rng=np.random.default_rng(0)), logits, 200)
    assert set(np.unique(draws)) == {1}
    freq = (_draws(make_sampler(1.0, top_p=0.7, rng=np.random.default_rng(1)), logits, 8000) == 1).mean()
    assert abs(freq - 0.5 / 0.8) < 0.03  # renormalised over the nucleus


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    draws = _draws(make_sampler(1.0, min_p=0.5, rng=np.random.default_rng(0)), logits)
    assert set(np.unique(draws)) == {0, 1}  # 0.15 < 0.5 * 0.5


def test_rows_are_sampled_independently():
    logits = np.full((2, 3), -30.0, dtype=np.float32)
    logits[0, 2] = logits[1, 0] = 30.0
    np.testing.assert_array_equal(make_sampler(1.0, rng=np.random.default_rng(0))(logits), [2, 0])


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1, 40)).astype(np.float32)
    history = np.array([3, 5, 5, 17, 39, 0], dtype=np.int64)
    (proc,) = make_logits_processors(repetition_penalty=1.3)
    ours = proc(history, logits)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(history[None]), torch.tensor(logits)).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    assert not np.allclose(ours, logits)


def test_presence_and_frequency_penalties():
    logits = np.zeros((1, 6), dtype=np.float32)
    history = np.array([1, 1, 1, 4], dtype=np.int64)
    procs = make_logits_processors(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_processors(procs, history, logits)
    np.testing.assert_allclose(out[0], [0, -(0.5 + 0.75), 0, 0, -(0.5 + 0.25), 0])
    assert np.all(logits == 0), "input logits must not be modified"


def test_no_processors_by_default():
    assert make_logits_processors() == []
    assert len(make_logits_processors(1.1, 0.1, 0.1)) == 2


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": float("inf")}, "presence_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_params_rejected(kwargs, word):
    with pytest.raises(DecodertError, match=word) as info:
        SamplingParams(**kwargs).validate()
    assert "\n" not in str(info.value)


def test_valid_params_accepted_and_normalised():
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       stop="END", stop_token_ids=[3]).validate()
    assert p.stop == ("END",) and p.stop_token_ids == (3,) and not p.greedy


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_candidate_search_equals_full_sort(scale, top_p):
    from decodert.runtime.decoding.sampling import _top_p

    rng = np.random.default_rng(int(scale * 100) + int(top_p * 1000))
    x = rng.standard_normal((3, 3000)) * scale  # flat to peaked: the candidate set must grow as needed
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    ranked = np.take_along_axis(probs, order, axis=-1)
    keep = np.zeros_like(probs, dtype=bool)
    np.put_along_axis(keep, order, np.cumsum(ranked, axis=-1) - ranked < top_p, axis=-1)
    np.testing.assert_allclose(_top_p(probs, top_p), np.where(keep, probs, 0.0))
