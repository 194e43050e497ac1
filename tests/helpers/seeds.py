"""The seed of every random input in the tests (test-only helper).

Tests whose inputs are fresh each run draw them from one seed per run: $DECODERT_TEST_SEED when set, else
drawn once at start. Each test (or module-scoped fixture) derives its own generator from that seed and its
pytest node id, so ``DECODERT_TEST_SEED=n`` repeats a failing test's inputs exactly, run alone or with the
rest, in any order. tests/conftest.py prints the run's seed in the session header and under every failure.
Tests with fixed inputs seed their generators with a constant instead (``np.random.default_rng(0)``);
tests/project/test_seeds.py checks that no test draws from an unseeded generator.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

RUN_SEED = int(os.environ.get("DECODERT_TEST_SEED") or np.random.SeedSequence().entropy % 2**31)


def seed_for(node_id: str) -> int:
    """The seed of ``node_id``'s random inputs in this run (a 31-bit int, from RUN_SEED and the id)."""
    digest = int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), "little")
    return int(np.random.SeedSequence([RUN_SEED, digest]).generate_state(1)[0]) % 2**31


def rng_for(request) -> np.random.Generator:
    """A generator for the test or fixture asking (``request``: pytest's, of any scope), seeded by seed_for."""
    return np.random.default_rng(seed_for(request.node.nodeid))


def repeat_line() -> str:
    """How to repeat this run's random inputs."""
    return f"DECODERT_TEST_SEED={RUN_SEED} repeats this run's random inputs"
