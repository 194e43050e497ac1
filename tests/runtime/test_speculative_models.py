"""Speculative decoding on exported models: tiny random checkpoints and SmolLM2.

Greedy speculative output must be token-for-token the plain greedy output of the same artifact
(itself checked against transformers by the battery), at batch 1 and batch 4; every tiny family's
greedy identity is the battery's (tests/helpers/battery.py, Runtime).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from battery import GROUNDED

from decodert.export.pipeline import export_model  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402
from decodert.runtime.speculation.speculative import SpeculativeConfig  # noqa: E402


def prompts(llm: LLM) -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    repeat = rng.integers(3, llm.backend.vocab_size, 6)
    return [llm.encode("Hello world! How are you today?"), llm.encode(GROUNDED),
            np.tile(repeat, 4), rng.integers(3, llm.backend.vocab_size, 9)]


def test_sampling_runs_on_a_real_model(tiny_checkpoint, tmp_path):
    out = tmp_path / "art"
    export_model(tiny_checkpoint("qwen2"), out, target="ort", max_seq=64, max_batch=4, progress=False)
    llm = LLM.load(out, backend="ort")
    kw = dict(max_new_tokens=20, temperature=0.8, top_p=0.9, repetition_penalty=1.1)
    fixed = SpeculativeConfig(adaptive=False)  # adaptive steps depend on timings, so on the draws made
    a = llm.generate(GROUNDED, seed=3, speculative=fixed, **kw)
    b = llm.generate(GROUNDED, seed=3, speculative=fixed, **kw)
    assert a.token_ids == b.token_ids and 1 <= len(a.token_ids) <= 20  # seeded: reproducible


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-spec") / "fp32"
    export_model(smollm2_gguf, out, target="ort", max_seq=512, max_batch=4, progress=False)
    return LLM.load(out, backend="ort")


@pytest.mark.slow
def test_smollm2_greedy_identical(smollm2_fp32):
    llm = smollm2_fp32
    chats = [[{"role": "user", "content": GROUNDED}],
             [{"role": "user", "content": "Add a docstring:\ndef area(w, h):\n    return w * h\n"}],
             [{"role": "user", "content": "List three colours."}],
             [{"role": "user", "content": "Extract the names: Ann (34, Paris), Bob (29, Rome), Cy (41, Oslo)."}]]
    plain = [llm.chat(m, max_new_tokens=64, temperature=0.0) for m in chats]
    spec = [llm.chat(m, max_new_tokens=64, temperature=0.0, speculative="ngram") for m in chats]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    batch = llm.generate_many([Request(messages=m, params=SamplingParams(max_new_tokens=64), speculative="ngram")
                               for m in chats])
    assert [r.token_ids for r in batch] == [r.token_ids for r in plain]
    assert max(r.metrics.accepted_per_step for r in spec) > 1.2


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ort_verify_takes_every_row_in_one_pass(tiny_checkpoint, tmp_path, family, monkeypatch):
    """The ort target's verify graph attends with standard ops (GQA refuses several rows of several
    tokens over a cache): one session run for 4 rows of different lengths and widths, and every
    position's choice equals what decode steps over the same tokens choose."""
    from decodert.runtime.backends.ort import backend as ort_backend

    m, be, cache = _ort_tiny(tiny_checkpoint, tmp_path, family)
    assert m.graphs["verify"].batched_past
    rng = np.random.default_rng(7)
    for slot, n in enumerate((5, 17, 9, 30)):
        be.prefill(cache, [slot], [rng.integers(3, be.vocab_size, n)], False)
    start = cache.lengths.copy()
    drafts = [rng.integers(3, be.vocab_size, w) for w in (4, 2, 6, 3)]
    runs = []
    real = ort_backend._run_bound
    monkeypatch.setattr(ort_backend, "_run_bound", lambda *a: (runs.append(a[3]), real(*a)))
    got = be.verify(cache, [0, 1, 2, 3], drafts, want_logits=True)
    assert runs == ["verify"]
    assert (cache.lengths == start + [4, 2, 6, 3]).all()
    monkeypatch.setattr(ort_backend, "_run_bound", real)
    for slot, ids in enumerate(drafts):
        cache.rewind(slot, int(start[slot]))
        for j, tok in enumerate(ids):
            step = be.decode(cache, [slot], np.array([tok]), want_logits=True)
            np.testing.assert_allclose(got.logits[slot, j], step.logits[0], atol=1e-4)
            assert got.next_tokens[slot, j] == step.next_token[0]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ort_one_row_verify_runs_in_the_prefill_session(tiny_checkpoint, tmp_path, family, monkeypatch):
    """A one-row verify pass goes through the prefill graph (per_position=1, its own attention):
    verify.onnx is never opened, and every position's logits equal the batched verify graph's and
    those of decode steps over the same tokens; plain prefill/decode leave per_position unbound."""
    from decodert.runtime.backends.ort import backend as ort_backend

    m, be, cache = _ort_tiny(tiny_checkpoint, tmp_path, family)
    assert m.graphs["prefill"].verifies_rows
    rng = np.random.default_rng(11)
    be.prefill(cache, [0], [rng.integers(3, be.vocab_size, 13)], False)
    start = int(cache.lengths[0])
    draft = rng.integers(3, be.vocab_size, 5)
    runs = []
    real = ort_backend._run_bound
    monkeypatch.setattr(ort_backend, "_run_bound", lambda *a: (runs.append(a[3]), real(*a)))
    got = be.verify(cache, [0], [draft], want_logits=True)
    assert runs == ["prefill"] and list(be._verify) == ["prefill"]
    assert cache.lengths[0] == start + 5
    cache.rewind(0, start)
    batched = be._verify_state(one_row=False)  # the verify graph over the same row
    io, ids_buf, past_buf, logits_buf, next_buf, _ = batched.binding(cache, 0, 1, 5)
    ids_buf[0], past_buf[0] = draft, start
    real(batched.session, io, be.dir, "verify")
    np.testing.assert_allclose(got.logits[0], logits_buf[0], atol=1e-4)
    monkeypatch.setattr(ort_backend, "_run_bound", real)
    for j, tok in enumerate(draft):
        step = be.decode(cache, [0], np.array([tok]), want_logits=True)
        np.testing.assert_allclose(got.logits[0, j], step.logits[0], atol=1e-4)
        assert got.next_tokens[0, j] == step.next_token[0]


def test_ort_several_speculative_rows_open_the_verify_session_before_the_plan_needs_it(tiny_checkpoint, tmp_path,
                                                                                      monkeypatch):
    """The first step of several speculative rows opens verify.onnx (1.5-1.8 s for SmolLM2 fp32)
    although it decodes (no step of that many rows measured yet), so the first verify pass the plan
    picks later does not stall a stream or a timed run; one row never opens it (prefill session)."""
    _ort_tiny(tiny_checkpoint, tmp_path, "llama")
    llm = LLM.load(tmp_path / "art", backend="ort")
    verifies = []
    real = llm.backend.verify
    monkeypatch.setattr(llm.backend, "verify", lambda cache, slots, *a, **k: (verifies.append(len(slots)),
                                                                              real(cache, slots, *a, **k))[1])
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    llm.generate(prompt, max_new_tokens=12, temperature=0.0, speculative="ngram")
    assert "verify" not in llm.backend._verify
    llm.generate_many([Request(prompt, SamplingParams(max_new_tokens=2), speculative="ngram")] * 2)
    assert all(n == 1 for n in verifies)  # the two-row run only decoded ...
    assert "verify" in llm.backend._verify  # ... and opened the session its verify passes need


def _ort_tiny(tiny_checkpoint, tmp_path, family):
    """(manifest, ort backend, its cache) of a tiny checkpoint exported for the ort target, 4 slots."""
    out = tmp_path / "art"
    m = export_model(tiny_checkpoint(family), out, target="ort", max_seq=64, max_batch=4, progress=False)
    be = LLM.load(out, backend="ort").backend
    return m, be, be.allocate()


def test_bench_verify_cost_prints_every_width(tiny_checkpoint, tmp_path, capsys):
    """bench/verify_cost.py (the verify-cost figures of docs/benchmarks/history.md) runs on an artifact."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import verify_cost

    out = tmp_path / "art"
    export_model(tiny_checkpoint("llama"), out, target="ort", max_seq=64, max_batch=2, progress=False)
    assert verify_cost.main([str(out), "--rows", "1,2", "--widths", "2,4", "--cached", "20", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rows 1", "rows 1", "rows 2", "rows 2"]
    assert "w2 " in lines[0] and "w4 " in lines[0] and "alternating decode / verify w5" in lines[1]


def test_bench_drafter_cost_checks_both_votes(tiny_checkpoint, tmp_path, capsys):
    """bench/drafter_cost.py (the drafter figures of docs/benchmarks/history.md) runs on an artifact, and
    the plain-Python vote and the numpy one draft the same on every step it replays."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import drafter_cost

    out = tmp_path / "art"
    export_model(tiny_checkpoint("llama"), out, target="ort", max_seq=1024, max_batch=1, progress=False)
    assert drafter_cost.main([str(out), "--gen", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["grounded", "free"] and all("same drafts" in x for x in lines)


def test_bench_ngram_ceiling_prints_every_policy(tiny_checkpoint, tmp_path, capsys):
    """bench/ngram_ceiling.py (the prompt-lookup ceiling table of docs/benchmarks/history.md) runs on an
    artifact, and its oracles are upper bounds of the drafters they are compared with."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import ngram_ceiling

    out = tmp_path / "art"
    export_model(tiny_checkpoint("llama"), out, target="ort", max_seq=1024, max_batch=1, progress=False)
    assert ngram_ceiling.main([str(out), "--costs", "1:20,2:21,9:30", "--gen", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["grounded", "free"]
    for line in lines:
        items = line.split(": ", 1)[1].split("  ")[1:]  # after "plain N tok/s"
        rate = {k: float(v) for k, v in (x.rsplit(" ", 1) for x in items)}
        assert rate["oracle trimmed"] >= rate["oracle choice"] >= max(rate["recent"], rate["voted"]) * 0.999


def test_bench_speculative_report_counts_every_repeat():
    """bench/speculative.py's table: tok/step and acceptance are means over every repeat, and a
    row is "same" only when every repeat gave the reference's tokens (the first repeat alone
    once decided both, so a repeat that never speculated set tok/step 1.00 beside a 1.23x median)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import speculative as bench

    jobs = [bench.Job("decodert", "fp32", 1, "plain", "p"), bench.Job("decodert", "fp32", 1, "ngram", "p")]
    reply = {"tokens": [1, 2, 3, 4, 5], "decode_s": 0.1}
    runs = {(0, "grounded"): [[reply], [reply]],
            (1, "grounded"): [[{**reply, "accepted_per_step": 1.0, "acceptance_rate": 0.0}],
                              [{**reply, "tokens": [1, 2, 3, 4, 6], "accepted_per_step": 3.0, "acceptance_rate": 0.5}]]}
    _, rows = bench.report(jobs, runs, {"grounded": None})
    plain, ngram = rows
    assert plain["same_tokens"] and not ngram["same_tokens"]
    assert ngram["accepted_per_step"] == 2.0 and ngram["acceptance"] == 0.25


def test_ort_verify_never_pads_a_row_past_its_context(tiny_checkpoint, tmp_path, monkeypatch):
    """A short row near the end of its context beside a longer one: one padded call would write K/V and
    take RoPE positions past max_seq for the short row, so it runs alone; every position still equals
    decode steps over the same tokens."""
    from decodert.runtime.backends.ort import backend as ort_backend

    m, be, cache = _ort_tiny(tiny_checkpoint, tmp_path, "llama")
    rng = np.random.default_rng(3)
    be.prefill(cache, [0], [rng.integers(3, be.vocab_size, 62)], False)  # 2 positions left
    be.prefill(cache, [1], [rng.integers(3, be.vocab_size, 10)], False)
    start = cache.lengths.copy()
    drafts = [rng.integers(3, be.vocab_size, 2), rng.integers(3, be.vocab_size, 6)]
    runs = []
    real = ort_backend._run_bound
    monkeypatch.setattr(ort_backend, "_run_bound", lambda *a: (runs.append(a[3]), real(*a)))
    got = be.verify(cache, [0, 1], drafts, want_logits=True)
    assert len(runs) == 2  # the rows apart: 62 + 6 > 64
    monkeypatch.setattr(ort_backend, "_run_bound", real)
    assert cache.lengths.tolist()[:2] == [64, 16]
    for slot, ids in enumerate(drafts):
        cache.rewind(slot, int(start[slot]))
        for j, tok in enumerate(ids):
            step = be.decode(cache, [slot], np.array([tok]), want_logits=True)
            np.testing.assert_allclose(got.logits[slot, j], step.logits[0], atol=1e-4)
