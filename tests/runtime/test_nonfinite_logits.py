"""Greedy decoding over NaN / inf scores (issue 45, 6), plain and speculative: the graph's ArgMax (of a decode
step or a verify pass) is not trusted where its score is not finite (ONNX Runtime's picks a leading NaN, so a
damaged model decoded token 0 forever). Such a row is chosen as ``greedy`` chooses from the logits (NaN never),
and a row with no finite score is the sampler's error."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from decodert.errors import DecodertError
from decodert.runtime.llm import LLM

PROMPT = [5, 17, 99, 3, 250, 41]


def _poison(art, name: str, rows: slice = slice(None)) -> None:
    """Set rows ``rows`` of weights.bin's float32 tensor ``name`` to NaN."""
    graph = onnx.load(str(art / "decode.onnx"), load_external_data=False)
    t = next(t for t in graph.graph.initializer if t.name == name)
    where = {e.key: int(e.value) for e in t.external_data if e.key in ("offset", "length")}
    w = np.memmap(art / "weights.bin", np.float32, "r+", where["offset"], (where["length"] // 4,)).reshape(list(t.dims))
    w[rows] = np.nan
    w.flush()
    del w


@pytest.fixture
def damaged(samples, tmp_path, monkeypatch):
    """make(weight, rows) -> an LLM over a copy of the tiny artifact with those rows NaN; its n-gram drafter
    always proposes tokens (verify passes run every step of a speculative generation)."""
    from decodert.runtime.speculation.drafters import NgramDrafter

    def propose(self, seqs, limits):
        return [np.array([5, 17, 99][: max(limit, 0)], np.int64) for limit in limits], [0] * len(seqs)

    monkeypatch.setattr(NgramDrafter, "propose", propose)

    def make(name: str, rows: slice = slice(None)) -> LLM:
        art = shutil.copytree(samples["art"], tmp_path / name)
        _poison(art, name, rows)
        return LLM.load(art, verify="none", prefix_cache_mb=0)
    return make


@pytest.mark.parametrize("speculative", [None, "ngram"])  # the graph's argmax of a decode step, and of a verify pass
def test_a_nan_token_score_is_never_greedy_s_choice(damaged, speculative):
    llm = damaged("lm_head", slice(0, 1))  # token 0's score NaN at every step, the others finite
    plain = llm.generate(PROMPT * 3, max_new_tokens=8, stop_token_ids=[], speculative=speculative).token_ids
    logged = llm.generate(PROMPT * 3, max_new_tokens=8, stop_token_ids=[], logprobs=True).token_ids  # over the logits
    assert plain == logged and 0 not in plain


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_no_finite_score_is_the_samplers_error_under_greedy(damaged, speculative):
    llm = damaged("final_norm")  # every score NaN
    with pytest.raises(DecodertError, match="no token has a finite score") as sampled:
        llm.generate(PROMPT, max_new_tokens=4, temperature=0.7, seed=1)
    with pytest.raises(DecodertError) as greedy:
        llm.generate(PROMPT, max_new_tokens=4, speculative=speculative)
    assert str(greedy.value) == str(sampled.value) and "\n" not in str(greedy.value)
