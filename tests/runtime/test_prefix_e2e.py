"""K/V reuse on real exported graphs (ONNX Runtime): greedy tokens are identical with and without
the prefix cache and sessions, on tiny random checkpoints of every family (Mistral with a
sliding window shorter than the prompts) and on SmolLM2."""


import numpy as np
import pytest

from tiny import FAMILIES  # noqa: E402

from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.prefix_cache import PrefixCache  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

SYSTEM = ("The cache keeps keys and values of earlier positions so each step only computes one token. "
          "A decoder-only transformer predicts the next token from the tokens before it. ")
QUESTIONS = ["Hello world! How are you today?", "def add(a, b):", "Once upon a time there was",
             "Numbers like 12, 345 and 6789", "The quick brown fox", "bonjour, hola, hallo."]
OVERRIDES = {"mistral": {"sliding_window": 16}}  # a window much shorter than the conversation


def _export(tiny_checkpoint, root, family, max_seq=160):
    pytest.importorskip("transformers")
    from decodert.export.pipeline import export_model

    ckpt = tiny_checkpoint(family, **OVERRIDES.get(family, {}))
    export_model(ckpt, root / "art", target="ort", dtype="fp32", max_seq=max_seq, max_batch=3, progress=False)
    return root / "art"


def _check_reuse_is_exact(art, block_tokens=8):
    off = LLM.load(art, prefix_cache_mb=0)
    on = LLM.load(art)
    on.prefix_cache = PrefixCache(on.backend, 1 << 20, block_tokens)  # small blocks: more boundaries
    prompts = [SYSTEM + q for q in QUESTIONS]
    reqs = [Request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    expected = [r.token_ids for r in off.generate_many(reqs)]
    got = on.generate_many(reqs)  # 6 requests through 3 slots: hits in the first admission and later
    assert [r.token_ids for r in got] == expected
    assert min(r.metrics.cached_tokens for r in got[1:]) >= block_tokens
    session, dropped = on.session(system="Answer in one line."), 0
    for q in QUESTIONS:  # 160 tokens of context: the session truncates on the way
        r = session.chat(q, max_new_tokens=12)
        assert r.token_ids == off.chat(session.history[:-1], max_new_tokens=12).token_ids
        dropped += session.last_turn.dropped_turns
    return on, session, dropped


def test_reuse_exact_tiny_llama(tiny_checkpoint, tmp_path):
    on, _, dropped = _check_reuse_is_exact(_export(tiny_checkpoint, tmp_path, "llama"))
    assert on.prefix_cache.stats.hits > 0 and dropped > 0


def test_reuse_exact_tiny_mistral_sliding_window(tiny_checkpoint, tmp_path):
    art = _export(tiny_checkpoint, tmp_path, "mistral")
    assert LLM.load(art).manifest.model.spec().attention.window == 16
    _, session, _ = _check_reuse_is_exact(art)
    assert session.last_turn.reused_tokens > 16  # reused K/V reaches past the window


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "mistral")])
def test_reuse_exact_tiny_families(tiny_checkpoint, tmp_path, family):
    _check_reuse_is_exact(_export(tiny_checkpoint, tmp_path, family))


def test_session_hits_max_seq_and_goes_on_exactly(tiny_checkpoint, tmp_path):
    art = _export(tiny_checkpoint, tmp_path, "qwen3", max_seq=64)
    llm, off = LLM.load(art), LLM.load(art, prefix_cache_mb=0)
    session = llm.session(system="Be brief.")
    dropped = 0
    for i in range(8):
        r = session.chat(QUESTIONS[i % len(QUESTIONS)], max_new_tokens=40)  # room kept: 32 tokens
        dropped += session.last_turn.dropped_turns
        assert r.token_ids == off.chat(session.history[:-1], max_new_tokens=40).token_ids
        assert r.metrics.prompt_tokens + len(r.token_ids) <= 64
    assert dropped > 0


@pytest.mark.slow
def test_reuse_exact_smollm2(smollm2_gguf, tmp_path):
    """SmolLM2-135M-Instruct: a 4-turn session and requests sharing a system prompt, with and without reuse."""
    from decodert.export.pipeline import export_model

    export_model(smollm2_gguf, tmp_path / "art", target="ort", dtype="fp32", max_seq=512, max_batch=2, progress=False)
    on, off = LLM.load(tmp_path / "art"), LLM.load(tmp_path / "art", prefix_cache_mb=0)
    system = "You are a helpful assistant. " + SYSTEM * 2
    session = on.session(system=system)
    for q in ("What is the capital of France?", "And of Italy?", "Name a river there.", "Thanks! One more fact?"):
        r = session.chat(q, max_new_tokens=24, temperature=0)
        assert r.token_ids == off.chat(session.history[:-1], max_new_tokens=24, temperature=0).token_ids
        if len(session.history) > 3:
            assert r.metrics.cached_tokens > 0.8 * r.metrics.prompt_tokens
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS[:4]]
    reqs = [Request(messages=m, params=SamplingParams(max_new_tokens=16, temperature=0)) for m in chats]
    got, expected = on.generate_many(reqs), off.generate_many(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(r.metrics.cached_tokens >= 64 for r in got)
    assert on.prefix_cache.stats.peak_bytes <= on.prefix_cache.budget_bytes


def test_tiny_budget_and_different_hit_lengths_exact_on_real_graphs(tiny_checkpoint, tmp_path):
    """ONNX Runtime graphs: one batch whose rows hit 0..n blocks, then eviction under a 3-block budget."""
    art = _export(tiny_checkpoint, tmp_path, "qwen2")
    off, on = LLM.load(art, prefix_cache_mb=0), LLM.load(art)
    ids = on.encode(SYSTEM + QUESTIONS[0], add_bos=False)
    on.prefix_cache = PrefixCache(on.backend, 1 << 20, 8)
    on.generate([ids], max_new_tokens=2)  # caches its whole blocks
    prompts = [np.r_[ids[:n], ids[:3]] for n in (2, 9, 17, 33)]  # hits of 0, 8, 16 and 32 ids
    got = on.generate(prompts, max_new_tokens=8)
    assert [r.metrics.cached_tokens for r in got] == [0, 8, 16, 32]
    assert [r.token_ids for r in got] == [r.token_ids for r in off.generate(prompts, max_new_tokens=8)]
    on.prefix_cache = PrefixCache(on.backend, 3 * on.prefix_cache.block_bytes, 8)
    reqs = [Request(SYSTEM[i * 7 :] + q, SamplingParams(max_new_tokens=6)) for i, q in enumerate(QUESTIONS)] * 2
    assert [r.token_ids for r in on.generate_many(reqs)] == [r.token_ids for r in off.generate_many(reqs)]
    stats = on.prefix_cache.stats
    assert stats.evicted_blocks > 0 and stats.peak_bytes <= on.prefix_cache.budget_bytes
