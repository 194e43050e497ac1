"""The verify graph (speculative decoding): k+1 tokens over rows that already have a cache.

Checked against the step-by-step decode of the same artifact (itself checked against
transformers in tests/export/test_export.py): per-position argmax and logits, ragged batches, rewind by
length only, every family and target, and the TensorRT profile.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiny import FAMILIES  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.artifact.manifest import load_manifest  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.runtime.backends.ort.backend import OrtBackend  # noqa: E402


@pytest.fixture(scope="module")
def artifact(tiny_checkpoint, tmp_path_factory):
    """(family, target) -> a tiny exported artifact (max_seq 64, max_batch 4), once per module."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, target: str = "ort") -> Path:
        if (family, target) not in made:
            out = tmp_path_factory.mktemp(f"verify-{family}-{target}") / "art"
            export_model(tiny_checkpoint(family), out, target=target, max_seq=64, max_batch=4, progress=False)
            made[family, target] = out
        return made[family, target]

    return get


def stepwise(be: OrtBackend, prompt: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(argmax [k], logits [k, V]) after each of ``tokens`` fed one decode step at a time after ``prompt``."""
    cache = be.allocate(1)
    be.prefill(cache, [0], [prompt], want_logits=False)
    outs = [be.decode(cache, [0], tokens[i : i + 1], want_logits=True) for i in range(len(tokens))]
    return np.array([o.next_token[0] for o in outs]), np.stack([o.logits[0] for o in outs])


def check_rows(be, prompts, drafts, out, atol=2e-3):
    for j, (p, d) in enumerate(zip(prompts, drafts)):
        want_ids, want_logits = stepwise(be, p, d)
        np.testing.assert_array_equal(out.next_tokens[j, : len(d)], want_ids)
        np.testing.assert_allclose(out.logits[j, : len(d)], want_logits, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_equals_stepwise_decode(artifact, family):
    be = OrtBackend(artifact(family), load_manifest(artifact(family)))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, n) for n in (5, 11, 2, 7)]
    drafts = [rng.integers(3, 500, n) for n in (4, 1, 6, 3)]  # ragged: rows are right-padded
    cache = be.allocate(4)
    be.prefill(cache, [0, 1, 2, 3], prompts, want_logits=False)
    out = be.verify(cache, [0, 1, 2, 3], drafts, want_logits=True)
    assert out.next_tokens.shape == (4, 6) and out.logits.shape == (4, 6, be.vocab_size)
    assert cache.lengths.tolist() == [len(p) + len(d) for p, d in zip(prompts, drafts)]
    check_rows(be, prompts, drafts, out)


@pytest.mark.parametrize("target", ["trt", "portable"])
def test_verify_other_targets_on_onnx_runtime(artifact, target):
    be = OrtBackend(artifact("qwen3", target), load_manifest(artifact("qwen3", target)))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, n) for n in (6, 3)]
    drafts = [rng.integers(3, 500, n) for n in (2, 5)]
    cache = be.allocate(2)
    be.prefill(cache, [0, 1], prompts, want_logits=False)
    check_rows(be, prompts, drafts, be.verify(cache, [0, 1], drafts, want_logits=True))


def test_rewind_is_only_the_length(artifact):
    """Rejected tokens stay in the buffer; setting the length back makes the next write replace them."""
    be = OrtBackend(artifact("llama"), load_manifest(artifact("llama")))
    rng = np.random.default_rng(3)
    prompt, wrong, right = rng.integers(3, 500, 9), rng.integers(3, 500, 5), rng.integers(3, 500, 4)
    cache = be.allocate(1)
    be.prefill(cache, [0], [prompt], want_logits=False)
    be.verify(cache, [0], [wrong], want_logits=False)
    cache.rewind(0, int(cache.lengths[0]) - 4)  # keep wrong[0] only
    out = be.verify(cache, [0], [right], want_logits=True)
    check_rows(be, [np.concatenate([prompt, wrong[:1]])], [right], out)
    assert be.verify(cache, [0], [right[:1]], want_logits=False).logits is None  # greedy: ids only


def test_verify_limits_and_old_artifacts(artifact):
    out = artifact("llama")
    manifest = load_manifest(out)
    assert manifest.graphs["verify"].max_tokens == 16 and (out / "verify.onnx").is_file()
    be = OrtBackend(out, manifest)
    cache = be.allocate(1)
    be.prefill(cache, [0], [np.arange(3, 60)], want_logits=False)
    with pytest.raises(DecodertError, match="1..16 tokens per row"):
        be.verify(cache, [0], [np.arange(3, 20)], want_logits=False)
    with pytest.raises(DecodertError, match="KV cache is full"):
        be.verify(cache, [0], [np.arange(3, 11)], want_logits=False)
    old = manifest.replace(graphs={k: v for k, v in manifest.graphs.items() if k != "verify"})
    be = OrtBackend(out, old)
    assert be.verify_width == 0
    with pytest.raises(DecodertError, match="no verify graph.*re-export"):
        be.verify(be.allocate(1), [0], [np.arange(3, 5)], want_logits=False)


def test_trt_profile_covers_the_verify_shapes(tiny_checkpoint, tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build

    out = tmp_path / "t"
    export_model(tiny_checkpoint("llama"), out, target="trt", dtype="fp16", max_seq=32, max_batch=2, progress=False)
    engines = trt_build.build_engines(out, progress=False)
    rec = engines["verify"]
    assert rec.profile["input_ids"] == {"min": [1, 1], "opt": [2, 8], "max": [2, 16]}
    assert rec.layers["KV_CACHE_UPDATE"] == 4 and "seq_lengths" not in rec.profile
    trt_build.check_io(rec.io, load_manifest(out).graphs["verify"], "verify")
