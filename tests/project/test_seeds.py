"""Every random input of the tests comes from a seed that is fixed or printed (tests/helpers/seeds.py).

Walks every Python file under tests/ with ``ast`` and refuses what draws from a generator nobody can
seed again: ``default_rng()`` or ``SeedSequence()`` without an argument, numpy's global-state functions
(``np.random.rand``, ``np.random.seed`` ...), the ``random`` module's functions and an unseeded
``random.Random()``, and torch's samplers without a ``generator=`` in a function that never calls
``torch.manual_seed``. Fresh inputs per run take the ``rng`` fixture (tests/conftest.py) or
``seeds.rng_for(request)``; fixed ones ``np.random.default_rng(0)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# where the run's seed itself is drawn (and printed by tests/conftest.py)
SEED_SOURCE = TESTS / "helpers" / "seeds.py"

NUMPY_SEEDABLE = {"default_rng", "Generator", "SeedSequence", "PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937",
                  "BitGenerator", "RandomState"}
RANDOM_MODULE = {"random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform", "gauss",
                 "normalvariate", "getrandbits", "randbytes", "seed", "betavariate", "expovariate", "triangular"}
TORCH_SAMPLERS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                  "bernoulli", "multinomial", "poisson"}


def _dotted(node: ast.AST) -> str:
    """``np.random.default_rng`` -> "np.random.default_rng"; anything not a plain name chain -> ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _unseeded(call: ast.Call, seeds_torch: bool) -> str | None:
    """Why ``call`` draws from an unseeded generator, or None."""
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    no_args = not call.args and not call.keywords
    if last in ("default_rng", "SeedSequence", "RandomState") and no_args:
        return f"{name}() without a seed"
    if name.startswith(("np.random.", "numpy.random.")) and name.count(".") == 2 and last not in NUMPY_SEEDABLE:
        return f"{name}: numpy's global generator"
    if name.startswith("random.") and name.count(".") == 1:
        if last in RANDOM_MODULE:
            return f"{name}: the random module's global generator"
        if last == "Random" and no_args:
            return "random.Random() without a seed"
    if name.startswith("torch.") and name.count(".") == 1 and last in TORCH_SAMPLERS and not seeds_torch:
        if not any(k.arg == "generator" for k in call.keywords):
            return f"{name} without generator= in a function that never calls torch.manual_seed"
    return None


def unseeded_calls(source: str, where: str = "<test>") -> list[str]:
    """'file:line: why' for every call in ``source`` that draws from a generator nobody can seed again."""
    tree = ast.parse(source)
    found = []

    def visit(node: ast.AST, seeds_torch: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            seeds_torch = seeds_torch or any(isinstance(n, ast.Call) and _dotted(n.func) == "torch.manual_seed"
                                             for n in ast.walk(node))
        if isinstance(node, ast.Call):
            why = _unseeded(node, seeds_torch)
            if why:
                found.append(f"{where}:{node.lineno}: {why}")
        for child in ast.iter_child_nodes(node):
            visit(child, seeds_torch)

    visit(tree, False)
    return found


def test_no_test_draws_from_an_unseeded_generator():
    files = sorted(p for p in TESTS.rglob("*.py") if p != SEED_SOURCE)
    assert len(files) > 90  # the walk found the tree
    found = [hit for f in files for hit in unseeded_calls(f.read_text(), str(f.relative_to(TESTS)))]
    assert not found, "seed these (a constant, or the rng fixture of tests/conftest.py):\n" + "\n".join(found)


@pytest.mark.parametrize("code,why", [
    ("import numpy as np\nx = np.random.default_rng().integers(9)", "np.random.default_rng() without a seed"),
    ("import numpy as np\nnp.random.shuffle(x)", "np.random.shuffle: numpy's global generator"),
    ("import numpy\nnumpy.random.seed(1)", "numpy.random.seed: numpy's global generator"),
    ("from numpy.random import default_rng\nr = default_rng()", "default_rng() without a seed"),
    ("import numpy as np\ns = np.random.SeedSequence().entropy", "np.random.SeedSequence() without a seed"),
    ("import random\nrandom.choice([1, 2])", "random.choice: the random module's global generator"),
    ("import random\nr = random.Random()", "random.Random() without a seed"),
    ("import torch\ndef f():\n    return torch.randn(3)", "torch.randn without generator="),
])
def test_the_walk_finds_each_kind(code, why):
    hits = unseeded_calls(code)
    assert len(hits) == 1 and why in hits[0], hits


def test_seeded_draws_pass():
    code = ("import numpy as np, random, torch\n"
            "a = np.random.default_rng(0)\nb = np.random.default_rng(seed)\nc = random.Random(3)\n"
            "d = torch.randn(3, generator=g)\n"
            "def f():\n    torch.manual_seed(1)\n    return torch.rand(2)\n"
            "e = rng.integers(5)\n")
    assert unseeded_calls(code) == []
