"""The prefix cache on hybrid models (LFM2 conv layers, Qwen3.5 Gated DeltaNet layers): K/V blocks
with the states the model computed at block boundaries (runtime/prefix_cache.py). Hits equal misses
token for token, greedy, batched and single, on tiny random checkpoints exported for the ort and
portable targets (an int8 K/V cache too), through a session's first turn and through the trt
backend on the emulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiny import make_tiny_checkpoint  # noqa: E402

from decodert.export.pipeline import export_model  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.prefix_cache import PrefixCache  # noqa: E402

BLOCK = 8


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    pytest.importorskip("transformers")
    made: dict[tuple, Path] = {}

    def get(family: str, target: str = "ort", kv_dtype: str | None = None) -> Path:
        key = (family, target, kv_dtype)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{family}-{target}-{kv_dtype}")
            src = make_tiny_checkpoint(family, root / "src")
            extra = {"kv_dtype": kv_dtype} if kv_dtype else {}
            export_model(src, root / "art", target=target, dtype="fp32", max_seq=96, max_batch=3, progress=False,
                         **extra)
            made[key] = root / "art"
        return made[key]

    return get


def _prompts(seed: int = 0) -> list[np.ndarray]:
    """Prompts sharing prefixes of several lengths: 21 and 45 tokens of one text, and one extending another."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 500, 45)
    ps = [np.r_[shared[:21], rng.integers(3, 500, 9)], np.r_[shared[:21], rng.integers(3, 500, 14)],
          np.r_[shared, rng.integers(3, 500, 5)], np.r_[shared[:30], rng.integers(3, 500, 3)]]
    return ps + [np.r_[ps[2], rng.integers(3, 500, 12)]]


def _with_cache(art: Path, backend: str = "ort") -> LLM:
    llm = LLM.load(art, backend=backend)
    llm.prefix_cache = PrefixCache(llm.backend, 8 << 20, BLOCK, state_every=16)  # small blocks: more boundaries
    return llm


def _hits_equal_misses(art: Path, backend: str = "ort") -> LLM:
    ps = _prompts()
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as off:
        want = [off.generate(p, max_new_tokens=10, temperature=0).token_ids for p in ps]
    on = _with_cache(art, backend)
    assert [on.generate(p, max_new_tokens=10, temperature=0).token_ids for p in ps] == want  # singles: misses, then hits
    stats = on.prefix_cache.stats
    assert stats.stored_states > 0 and stats.hits >= 3, stats
    reqs = [Request(p, SamplingParams(max_new_tokens=10, temperature=0)) for p in ps]
    got = on.generate_many(reqs)  # batched, every prompt a hit now
    assert [r.token_ids for r in got] == want
    assert all(r.metrics.cached_tokens >= BLOCK for r in got)
    on.prefix_cache.clear()
    got = on.generate_many(reqs)  # batched from an empty cache: the shared first blocks run once, then load
    assert [r.token_ids for r in got] == want
    return on


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5", "nemotron_h"])  # nemotron_h: Mamba2 states at the boundaries
def test_hits_equal_misses_ort(artifacts, family):
    on = _hits_equal_misses(artifacts(family))
    for e in on.prefix_cache._entries.values():  # a state only where a boundary was stopped at; every entry counted
        assert e.nbytes == on.prefix_cache.block_bytes + (sum(map(len, e.state)) if e.state else 0)
    assert on.prefix_cache.nbytes == sum(e.nbytes for e in on.prefix_cache._entries.values())


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_hits_equal_misses_portable(artifacts, family):
    _hits_equal_misses(artifacts(family, "portable"))


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_hits_equal_misses_int8_kv(artifacts, family):
    on = _hits_equal_misses(artifacts(family, "ort", "int8"))
    assert all(e.kv[0].dtype == np.int8 for e in on.prefix_cache._entries.values())


def test_a_boundary_without_state_is_not_loaded(artifacts):
    """K/V blocks cached below a prompt's deepest state are used only up to a boundary that has one;
    a prompt whose shared part ends where nothing stopped reuses nothing the first time, and stops
    there itself, so the next one loads it."""
    llm = _with_cache(artifacts("lfm2"))
    rng = np.random.default_rng(3)
    base = rng.integers(3, 500, 44)  # states stored at 16, 32 (every 16) and 40 (its last whole block)
    llm.generate(base, max_new_tokens=2, temperature=0)
    cut = np.r_[base[:27], rng.integers(3, 500, 6)]  # shares 27 tokens: blocks to 24, states at 16 only
    first = llm.generate(cut, max_new_tokens=2, temperature=0)
    assert first.metrics.cached_tokens == 16  # the deepest boundary with a state, not the 24 K/V reach
    other = np.r_[base[:25], rng.integers(3, 500, 9)]
    assert llm.generate(other, max_new_tokens=2, temperature=0).metrics.cached_tokens == 24  # cut stopped at 24
    llm.prefix_cache.budget_bytes = llm.prefix_cache.block_bytes  # a state does not fit: nothing stored, nothing stops
    assert llm.prefix_cache.stops(llm.engine.cache or llm.backend.allocate(1), 0, base) == []


def test_session_first_turn_stores_and_later_turns_load(artifacts):
    art = artifacts("qwen3_5")
    llm = _with_cache(art)
    system = "You are a helpful assistant. Answer in one short line, please."
    a = llm.session(system=system)
    r1 = a.chat("Hello world!", max_new_tokens=6, temperature=0)
    b = llm.session(system=system)
    r2 = b.chat("Hello world!", max_new_tokens=6, temperature=0)
    assert r2.token_ids == r1.token_ids and b.last_turn.reused_tokens >= BLOCK
    with LLM.load(art, prefix_cache_mb=0) as off:
        again = off.chat(b.history[:-1], max_new_tokens=6, temperature=0)
    assert again.token_ids == r2.token_ids


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_trt_backend_on_the_emulator(artifacts, family, monkeypatch):
    """The trt backend's device K/V blocks and its device states (read to the host, written back)."""
    import trt_emulator

    art = artifacts(family, "trt")
    trt_emulator.emulate_engines(art)
    trt_emulator.install(monkeypatch)
    ps = _prompts(1)[:3]
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as off:
        want = [off.generate(p, max_new_tokens=6, temperature=0).token_ids for p in ps]
    with _with_cache(art, "trt") as on:
        assert [on.generate(p, max_new_tokens=6, temperature=0).token_ids for p in ps] == want
        assert [on.generate(p, max_new_tokens=6, temperature=0).token_ids for p in ps] == want
        assert on.prefix_cache.stats.hit_tokens >= 3 * BLOCK


def test_server_reuses_a_hybrid_prefix(artifacts):
    """Through the server's engine thread (OpenAI completions): the second prompt sharing a start reports
    cached tokens and answers as without the cache."""
    pytest.importorskip("openai")
    import openai
    from serve_helpers import running

    art = artifacts("lfm2")
    shared = "the quick brown fox jumps over the lazy dog, hello world. "
    with LLM.load(art, prefix_cache_mb=0) as off:
        want = [off.generate(shared + tail, max_new_tokens=6, temperature=0).text for tail in ("12", "345 6")]
    on = _with_cache(art)
    with running(on) as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        got = [c.completions.create(model="tiny", prompt=shared + tail, max_tokens=6, temperature=0)
               for tail in ("12", "345 6")]
    assert [g.choices[0].text for g in got] == want
    assert got[0].usage.prompt_tokens_details.cached_tokens == 0
    assert got[1].usage.prompt_tokens_details.cached_tokens >= BLOCK


def test_prompts_admitted_together_share_a_boundary(artifacts):
    """A fresh cache, one admission: the first prompt stops where it shares blocks with the others
    (``split_shared``), so they wait one call and load its states there, not only its K/V."""
    art = artifacts("qwen3_5")
    ps = _prompts()[:3]  # 30, 35 and 50 tokens; the first 21 shared: boundary 16
    llm = LLM.load(art, backend="ort")
    llm.prefix_cache = PrefixCache(llm.backend, 8 << 20, BLOCK, state_every=1024)  # no stride stops
    reqs = [Request(p, SamplingParams(max_new_tokens=6, temperature=0)) for p in ps]
    got = llm.generate_many(reqs)
    assert [r.metrics.cached_tokens for r in got] == [0, 16, 16]
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as off:
        assert [r.token_ids for r in got] == [r.token_ids for r in off.generate_many(reqs)]
