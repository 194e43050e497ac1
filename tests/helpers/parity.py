"""Parity helpers: run an exported artifact with the ORT backend next to a transformers model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from decodert.artifact.manifest import load_manifest
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
