"""Parity helpers: run an exported artifact with the ORT backend next to a transformers model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from decodert.export.artifact.manifest import load_manifest
from decodert.runtime.backends.ort.backend import OrtBackend


def backend(out: Path) -> OrtBackend:
    """Both exported graphs: prefill for the prompt, the decode graph for steps."""
    return OrtBackend(out, load_manifest(out, verify="full"), separate_decode=True)


def hf_reference(model, prompt: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
    """transformers greedy decoding with its own KV cache, never stopping early.

    Returns (n greedy tokens, logits [n, V]): logits[j] predicts token j.
    """
    ids = torch.tensor([list(map(int, prompt))])
    toks, logits, past = [], [], None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, cache=past, use_cache=True)
            past = res.cache
            row = res.logits[0, -1].float().numpy()
            logits.append(row)
            toks.append(int(row.argmax()))
            ids = torch.tensor([[toks[-1]]])
    return toks, np.stack(logits)


def logits_parity(out: Path, refs: list[tuple[list[int], np.ndarray]], prompts: list[np.ndarray],
                  steps: int = 16) -> float:
    """Prefill all prompts as one right-padded batch, then ``steps`` decode steps fed with the
    reference's tokens (teacher forcing), comparing every row's logits at every step.

    Returns the worst max|diff| / max|ref| over rows and steps.
    """
    be = backend(out)
    cache = be.allocate(len(prompts))
    slots = list(range(len(prompts)))
    step = be.prefill(cache, slots, prompts, want_logits=True)
    worst = 0.0
    for j in range(steps + 1):
        for b, (_, ref_logits) in enumerate(refs):
            ref = ref_logits[j]
            worst = max(worst, float(np.abs(step.logits[b] - ref).max() / np.abs(ref).max()))
            assert step.next_token[b] == int(np.argmax(step.logits[b]))
        if j < steps:
            fed = np.array([toks[j] for toks, _ in refs], np.int64)
            step = be.decode(cache, slots, fed, want_logits=True)
    return worst


def decodert_greedy(be: OrtBackend, prompts: list[np.ndarray], n: int) -> list[list[int]]:
    """Greedy tokens for a batch of prompts through the backend (next_token from the graph)."""
    cache = be.allocate(len(prompts))
    slots = list(range(len(prompts)))
    step = be.prefill(cache, slots, prompts, want_logits=False)
    toks = [[int(t)] for t in step.next_token]
    for _ in range(n - 1):
        step = be.decode(cache, slots, step.next_token.copy(), want_logits=False)
        for row, t in zip(toks, step.next_token):
            row.append(int(t))
    return toks


def random_prompts(lengths, seed: int = 0, vocab: int = 512) -> list[np.ndarray]:
    """Prompts of random token ids in [3, vocab), one per length (the parity tests' inputs)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).astype(np.int64) for n in lengths]


# ---- behaviour every family's greedy decode must keep (the hybrid families' test files call these) --------------
def check_continuous_batching(llm) -> None:
    """More requests (5) than slots (the artifact's max_batch 4): rows finish at different steps, new ones take
    their slots; every request's tokens equal its single run's."""
    from decodert.runtime.decoding.sampling import SamplingParams
    from decodert.runtime.llm import Request

    rng = np.random.default_rng(7)
    ps = [rng.integers(3, 512, n) for n in (3, 70, 8, 1, 12)]
    lens = (9, 4, 14, 6, 3)
    singles = [llm.generate(p, max_new_tokens=n, temperature=0).token_ids for p, n in zip(ps, lens)]
    got = llm.generate_many([Request(p, SamplingParams(max_new_tokens=n, temperature=0)) for p, n in zip(ps, lens)])
    assert [r.token_ids for r in got] == singles


def check_speculation(llm) -> None:
    """Greedy n-gram speculation and a fixed-width batched draft give the plain greedy tokens."""
    from decodert.runtime.decoding.sampling import SamplingParams
    from decodert.runtime.llm import Request
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    rng = np.random.default_rng(4)
    ps = [np.tile(rng.integers(3, 512, 6), 4), rng.integers(3, 512, 9), np.tile(rng.integers(3, 512, 3), 5)]
    plain = [llm.generate(p, max_new_tokens=40) for p in ps]
    spec = [llm.generate(p, max_new_tokens=40, speculative="ngram") for p in ps]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    fixed = SpeculativeConfig(adaptive=False, draft_len=5)
    batch = llm.generate_many([Request(p, SamplingParams(max_new_tokens=40), speculative=fixed) for p in ps])
    assert [r.token_ids for r in batch] == [r.token_ids for r in plain]


def check_session_turns(llm) -> None:
    """Each session turn's tokens equal a full re-prefill of the conversation so far."""
    session = llm.session(system="be brief")
    for question in ("Hello world!", "How are you today?", "The quick brown fox"):
        r = session.chat(question, max_new_tokens=8)
        again = llm.generate(llm._chat_ids(session.history[:-1]), max_new_tokens=8)
        assert r.token_ids == again.token_ids


def check_greedy(out: Path, prompts: list[np.ndarray], refs: list[tuple[list[int], np.ndarray]], n: int) -> None:
    """The artifact's greedy tokens (prefill + decode graphs) equal the reference's, for the batch of uneven rows
    and for each row alone."""
    be = backend(out)
    want = [toks for toks, _ in refs]
    assert decodert_greedy(be, prompts, n) == want
    singles = [decodert_greedy(be, [p], n)[0] for p in prompts]  # the batch of uneven rows equals the singles
    assert singles == want


def check_trt_engines(src: Path, out: Path) -> None:
    """A hybrid with one attention layer exports at fp16 for trt and TensorRT-RTX builds every engine: its io is
    the manifest's, the recurrent state stays float32, K and V are written by the one attention layer, and
    prefill's token loop became a TensorRT loop."""
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    export_model(src, out, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False)
    engines = trt_build.build_engines(out, progress=False)
    m = load_manifest(out)
    assert {(s.name, s.dtype) for s in m.kv.states} == {("conv", None), ("recurrent", "fp32")}
    for name, rec in engines.items():
        trt_build.check_io(rec.io, m.graphs[name], name)
        assert rec.layers["KV_CACHE_UPDATE"] == 2, name  # the one attention layer's K and V
    assert any("LOOP" in kind or "RECURRENCE" in kind for kind in engines["prefill"].layers)


def check_trt_emulated(ref: Path, art: Path, monkeypatch) -> None:
    """The trt backend on trt artifact ``art`` (tests/helpers/trt_emulator.py runs its engines' graphs on the CPU) gives
    the ort backend's greedy tokens on ``ref``: single requests, uneven batches (rows end, slots move) and
    fixed-width speculation."""
    import trt_emulator

    from decodert.runtime.decoding.sampling import SamplingParams
    from decodert.runtime.llm import LLM, Request
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    trt_emulator.emulate_engines(art)
    trt_emulator.install(monkeypatch)
    rng = np.random.default_rng(2)
    ps = [np.tile(rng.integers(3, 512, 5), 3), rng.integers(3, 512, 9), rng.integers(3, 512, 2)]
    with LLM.load(ref, backend="ort") as reference, LLM.load(art, backend="trt") as llm:
        want = [reference.generate(p, max_new_tokens=20, temperature=0).token_ids for p in ps]
        assert [llm.generate(p, max_new_tokens=20, temperature=0).token_ids for p in ps] == want
        uneven = [SamplingParams(max_new_tokens=n, temperature=0) for n in (20, 5, 12)]
        got = llm.generate_many([Request(p, sp) for p, sp in zip(ps, uneven)])
        assert [r.token_ids for r in got] == [w[: sp.max_new_tokens] for w, sp in zip(want, uneven)]
        fixed = SpeculativeConfig(adaptive=False, draft_len=6)
        reqs = [Request(p, SamplingParams(max_new_tokens=20, temperature=0), speculative=fixed) for p in ps[:2]]
        assert [r.token_ids for r in llm.generate_many(reqs)] == want[:2]


def check_verify_after_prefill(backend, ids, steps: int = 3) -> list[int]:
    """Prefill ``ids``, ``steps`` decode steps; then verify passes of those tokens (1 row: the prefill graph or
    engine, per position; 2 rows: the verify graph's own attention) give the decode steps' logits and tokens.
    Returns the greedy tokens (the prefill's, then the steps')."""
    cache = backend.allocate(1)
    tokens = [int(backend.prefill(cache, [0], [ids], False).next_token[0])]
    logits = []
    for _ in range(steps):
        out = backend.decode(cache, [0], np.array(tokens[-1:], np.int64), True)
        logits.append(out.logits[0])
        tokens.append(int(out.next_token[0]))
    for rows in (1, 2):
        cache = backend.allocate(rows)
        backend.prefill(cache, list(range(rows)), [ids] * rows, False)
        verified = backend.verify(cache, list(range(rows)), [np.array(tokens[:steps], np.int64)] * rows, True)
        for r in range(rows):
            np.testing.assert_allclose(verified.logits[r], np.stack(logits), atol=1e-4, rtol=1e-4)
            assert verified.next_tokens[r].tolist() == tokens[1:]
    return tokens
