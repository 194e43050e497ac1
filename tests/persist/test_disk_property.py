"""A model check of the disk tier over the fake backend (its "K/V" are the ids; the hybrid fake's state is a function
of every id, asserted by each call): random prompts sharing prefixes, restarts (a new LLM and prefix cache on the same
folder), files damaged, deleted or replaced by another prompt's block between runs, budgets from a few blocks up.
Every greedy answer equals the model run from scratch, every prefix entry's K/V are its ids, nothing crashes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_backend import FakeBackend, fake_manifest, make_tokenizer, reference_tokens  # noqa: E402

from decodert.artifact.artifact_files import FileRecord
from decodert.runtime.llm import LLM
from decodert.runtime.persist.disk_tier import DiskTier
from decodert.runtime.prefix_cache import PrefixCache

B = 4
TOKENIZER = make_tokenizer()


class DiskFake(FakeBackend):
    """The fake backend with the byte verbs the disk tier needs (a block is its ids, int64)."""

    def kv_to_bytes(self, block: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(block, np.int64).view(np.uint8)

    def kv_from_bytes(self, cache, data: np.ndarray, n: int) -> np.ndarray:
        if data.nbytes != 8 * n:
            raise ValueError("size")
        return data.view(np.int64).copy()


def _life(root: Path, states: bool, disk_blocks: int) -> LLM:
    backend = DiskFake(vocab_size=TOKENIZER.get_vocab_size(), max_seq=64, max_batch=2, states=states)
    manifest = fake_manifest(backend)
    manifest = manifest.replace(files={"weights.bin": FileRecord(size=1, sha256="1" * 64)})
    llm = LLM(backend, TOKENIZER, manifest, prefix_cache_mb=0)
    prefix = PrefixCache(backend, 64 * backend.kv_bytes(B), B, state_every=8)
    per_file = 700 + 8 * B + (16 if states else 0)  # about one block file
    prefix.attach_disk(lambda stats: DiskTier(root, manifest, disk_blocks * per_file, stats))
    llm.prefix_cache = prefix
    return llm


def _check_entries(prefix: PrefixCache) -> None:
    for e in prefix._entries.values():
        np.testing.assert_array_equal(e.kv, e.ids)


steps = st.lists(st.one_of(
    st.tuples(st.just("ask"), st.integers(0, 3), st.integers(0, 4), st.integers(1, 6)),  # shared prefix k, tail, new
    st.tuples(st.just("restart"), st.integers(3, 40), st.just(0), st.just(0)),  # the disk budget in blocks
    st.tuples(st.just("damage"), st.integers(0, 3), st.integers(0, 10 ** 6), st.just(0)),
), min_size=4, max_size=16)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps, states=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_restarts_and_damage_never_change_an_answer(steps, states, seed):
    rng = np.random.default_rng(seed)
    vocab = TOKENIZER.get_vocab_size()
    shared = [rng.integers(3, vocab, 8 * (k + 1)) for k in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "notes.txt").write_text("mine")
        llm = _life(root, states, 40)
        for what, a, b, c in steps:
            if what == "ask":
                prompt = np.r_[shared[a], np.random.default_rng(b).integers(3, vocab, b % 7)]
                got = llm.generate(prompt, max_new_tokens=c, temperature=0).token_ids
                assert got == reference_tokens(llm.backend, prompt, c)
                _check_entries(llm.prefix_cache)
            elif what == "restart":
                llm.close()
                llm = _life(root, states, a)
            else:
                llm.prefix_cache.disk.flush()
                files = sorted(root.glob("*/*.blk"))
                if files:
                    path = files[b % len(files)]
                    data = path.read_bytes()
                    if a == 0:
                        path.write_bytes(data[: b % max(len(data), 1)])
                    elif a == 1 and data:
                        flipped = bytearray(data)
                        flipped[b % len(data)] ^= 1 << (b % 8)
                        path.write_bytes(bytes(flipped))
                    elif a == 2:
                        path.unlink()
                    else:  # another block's whole file under this name: its ids differ, a miss
                        other = files[(b + 1) % len(files)]
                        path.write_bytes(other.read_bytes())
        llm.close()
        assert (root / "notes.txt").read_text() == "mine"



@pytest.mark.parametrize("states", [False, True])
def test_the_fake_reads_back_from_disk(tmp_path, states):
    """What the model check relies on: a restart over the fake reads the blocks back (a hybrid's up to its state)."""
    prompt = np.random.default_rng(0).integers(3, TOKENIZER.get_vocab_size(), 23)
    llm = _life(tmp_path, states, 40)
    want = llm.generate(prompt, max_new_tokens=4, temperature=0).token_ids
    llm.close()
    llm = _life(tmp_path, states, 40)
    got = llm.generate(prompt, max_new_tokens=4, temperature=0)
    llm.close()
    assert got.token_ids == want == reference_tokens(llm.backend, prompt, 4)
    assert got.metrics.cached_tokens == 20 and llm.prefix_cache.stats.disk_hits == 1
