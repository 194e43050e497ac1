"""The block prefix cache (runtime/prefix_cache.py) over the fake backend, whose "K/V" is the token
ids themselves and whose logits depend on the whole history: a block copied to the wrong
position or from the wrong prompt changes the output."""


import numpy as np
import pytest

from fake_backend import FakeBackend, make_llm, reference_tokens  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime import prefix_cache as pc  # noqa: E402
from decodert.runtime.llm import Request  # noqa: E402
from decodert.runtime.prefix_cache import PrefixCache  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

B = 4  # block tokens in these tests


def _filled(backend, ids, slot=0):
    """A cache whose slot holds ``ids`` (prefilled through the backend)."""
    cache = backend.allocate(2)
    backend.prefill(cache, [slot], [np.asarray(ids, np.int64)], want_logits=False)
    return cache


def _check_invariants(prefix: PrefixCache) -> None:
    entries = list(prefix._entries.values())
    assert prefix.nbytes == sum(e.nbytes for e in entries) <= prefix.budget_bytes
    for e in entries:  # every block is reachable: its parent is cached, and counts its children
        assert e.parent is None or prefix._entries.get(e.parent.key) is e.parent
        assert e.children == sum(1 for c in entries if c.parent is e)


def test_store_then_load_whole_blocks_only():
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=1 << 20, block_tokens=B)
    ids = np.arange(10, 21)  # 11 ids: 2 whole blocks + 3
    assert prefix.store(_filled(backend, ids), 0) == 2
    cache = backend.allocate(2)
    assert prefix.load(cache, 1, np.r_[ids[:9], 99, 98]) == 8  # 2 blocks reused, 3 ids left to prefill
    np.testing.assert_array_equal(cache.tokens[1, :8], ids[:8])
    assert cache.lengths[1] == 8 and cache.lengths[0] == 0
    assert prefix.load(backend.allocate(1), 0, np.r_[ids[:5], 7]) == 4  # diverges inside block 2
    assert prefix.load(backend.allocate(1), 0, np.r_[99, ids[1:]]) == 0  # first id differs
    assert prefix.stats.hits == 2 and prefix.stats.hit_tokens == 12 and prefix.stats.lookups == 3


def test_load_leaves_the_last_prompt_token_to_run():
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=1 << 20, block_tokens=B)
    ids = np.arange(30, 38)  # exactly 2 blocks
    prefix.store(_filled(backend, ids), 0)
    assert prefix.load(backend.allocate(1), 0, ids) == 4  # not 8: the last token's logits are needed
    assert prefix.load(backend.allocate(1), 0, np.r_[ids, 5]) == 8


def test_load_after_a_partial_row_copies_only_what_is_missing():
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=1 << 20, block_tokens=B)
    ids = np.arange(40, 53)  # 3 blocks + 1
    prefix.store(_filled(backend, ids), 0)
    cache = _filled(backend, ids[:6])  # the row already holds 6 of them
    backend.calls.clear()
    assert prefix.load(cache, 0, ids) == 12
    assert [c[1] for c in backend.calls if c[0] == "write_kv"] == [(0, 4, 4), (0, 8, 4)]  # blocks 2 and 3
    assert prefix.load(_filled(backend, ids[:9]), 0, ids[:10]) == 9  # a shorter hit changes nothing


def test_eviction_under_a_tiny_budget_keeps_bytes_in_budget_and_chains_whole():
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=3 * backend.kv_bytes(B), block_tokens=B)
    a = np.arange(1, 21)  # 5 blocks
    assert prefix.store(_filled(backend, a), 0) == 3  # a chain is never evicted by itself
    _check_invariants(prefix)
    b = np.arange(50, 62)  # 3 other blocks: evicts a's blocks, deepest first
    assert prefix.store(_filled(backend, b), 0) == 3
    _check_invariants(prefix)
    assert prefix.stats.evicted_blocks == 3 and len(prefix) == 3 and prefix.stats.peak_bytes <= prefix.budget_bytes
    assert prefix.load(backend.allocate(1), 0, np.r_[a, 0]) == 0
    assert prefix.load(backend.allocate(1), 0, np.r_[b, 0]) == 12


def test_lru_evicts_the_least_recently_used_chain():
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=4 * backend.kv_bytes(B), block_tokens=B)
    a, b, c = np.arange(1, 9), np.arange(20, 28), np.arange(40, 48)  # 2 blocks each
    for ids in (a, b):
        prefix.store(_filled(backend, ids), 0)
    prefix.load(backend.allocate(1), 0, np.r_[a, 0])  # a is now the most recent
    prefix.store(_filled(backend, c), 0)
    _check_invariants(prefix)
    assert prefix.load(backend.allocate(1), 0, np.r_[a, 0]) == 8
    assert prefix.load(backend.allocate(1), 0, np.r_[b, 0]) == 0
    assert prefix.load(backend.allocate(1), 0, np.r_[c, 0]) == 8


def test_zero_budget_or_oversized_block_stores_nothing():
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=backend.kv_bytes(B) - 1, block_tokens=B)
    ids = np.arange(12)
    assert prefix.store(_filled(backend, ids), 0) == 0 and prefix.nbytes == 0


def test_a_hash_collision_never_returns_other_ids(monkeypatch):
    monkeypatch.setattr(pc, "_chain_key", lambda parent, block: b"same")  # every block collides
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=1 << 20, block_tokens=B)
    a = np.arange(1, 10)
    prefix.store(_filled(backend, a), 0)
    assert prefix.load(backend.allocate(1), 0, np.arange(60, 70)) == 0  # ids compared, not just keys
    assert prefix.load(backend.allocate(1), 0, a) == 4


def test_store_keeps_what_the_row_holds_and_load_refuses_a_row_that_holds_other_ids():
    """store takes no ids: the blocks it keeps are the row's K/V with the ids the cache recorded for them
    (a row rewound after drafts keeps only what it still holds). load needs the row to hold a prefix of the prompt."""
    backend = FakeBackend(max_seq=64)
    prefix = PrefixCache(backend, budget_bytes=1 << 20, block_tokens=B)
    ids = np.arange(10, 10 + 3 * B, dtype=np.int64)
    cache = _filled(backend, ids)
    cache.rewind(0, 2 * B + 1)  # the third block's K/V is still in the buffers, but no longer held
    assert prefix.store(cache, 0) == 2
    assert all(np.array_equal(e.ids, e.kv) for e in prefix._entries.values())  # the fake's K/V are ids
    assert prefix.load(backend.allocate(1), 0, ids) == 2 * B
    with pytest.raises(DecodertError, match="do not begin"):
        prefix.load(_filled(backend, [1, 2, 3]), 0, ids)


# -- through the LLM: generate / generate_many --------------------------------------------------------
def _prompts(shared: int, tails: list[list[int]]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    head = rng.integers(3, 90, shared)
    return [np.r_[head, t].astype(np.int64) for t in tails]


def test_generate_many_identical_with_and_without_the_cache_and_counts_cached_tokens():
    llm = make_llm(max_seq=96, max_batch=2, prefix_cache_mb=1)
    prompts = _prompts(40, [[5, 6], [7], [8, 9, 10], [11], [12, 13]])
    reqs = [Request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    results = llm.generate_many(reqs)
    assert [r.token_ids for r in results] == [reference_tokens(llm.backend, p, 6) for p in prompts]
    block = llm.prefix_cache.block_tokens  # 32: the shared 40 ids hold one whole block
    # the first two share an uncached block: the second waits one call and loads it
    assert [r.metrics.cached_tokens for r in results] == [0] + [block] * 4
    assert "(32 cached)" in results[1].metrics.summary()
    again = llm.generate(prompts[0], max_new_tokens=6)
    assert again.token_ids == results[0].token_ids and again.metrics.cached_tokens == block


def test_batch_rows_with_different_hit_lengths():
    llm = make_llm(max_seq=96, max_batch=4)
    llm.prefix_cache = PrefixCache(llm.backend, 1 << 20, block_tokens=8)
    base = _prompts(40, [[]])[0]
    llm.generate(base, max_new_tokens=2)  # caches its 5 blocks of 8
    prompts = [np.r_[base[:n], 1, 2, 3] for n in (3, 12, 25, 40)]  # hits of 0, 8, 24 and 40 ids
    llm.backend.calls.clear()
    results = llm.generate(prompts, max_new_tokens=5)
    assert [c[1] for c in llm.backend.calls if c[0] == "prefill"] == [(0, 1, 2, 3)]  # one call, 4 hit lengths
    assert [r.metrics.cached_tokens for r in results] == [0, 8, 24, 40]
    assert [r.token_ids for r in results] == [reference_tokens(llm.backend, p, 5) for p in prompts]


def test_generated_blocks_are_kept_when_a_request_ends():
    llm = make_llm(max_seq=96, max_batch=1, prefix_cache_mb=1)
    prompt = _prompts(20, [[]])[0]
    first = llm.generate(prompt, max_new_tokens=40)
    follow_up = np.r_[prompt, first.token_ids[:30], 4]  # the conversation goes on: its reply is cached
    r = llm.generate(follow_up, max_new_tokens=4)
    assert r.metrics.cached_tokens == 32 * (len(follow_up) // 32)
    assert r.token_ids == reference_tokens(llm.backend, follow_up, 4)


@pytest.mark.parametrize("bad", [-1, "64", True, float("nan")])
def test_prefix_cache_mb_must_be_a_non_negative_number(bad):
    with pytest.raises(DecodertError, match="prefix_cache_mb"):
        make_llm(prefix_cache_mb=bad)


def test_prefix_cache_off_and_default():
    assert make_llm(prefix_cache_mb=0).prefix_cache is None
    llm = make_llm(max_seq=64)
    assert llm.prefix_cache.budget_bytes == 2 * llm.backend.kv_bytes(64)
    assert llm.generate([5, 6, 7], max_new_tokens=2).metrics.cached_tokens == 0
