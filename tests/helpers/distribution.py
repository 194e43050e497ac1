"""The exact-distribution check of speculative sampling against a transformers target: a draft method's three
sampled tokens (the first from the prefill, the next two from one verify pass of two drafts: accepted, or rejected
and resampled, then the bonus token) against the joint distribution the target's own logits give under the same
temperature / top-k transform, with plain sampling as the control (a pooled chi-square per method)."""

from __future__ import annotations

import numpy as np
import torch


def assert_keeps_the_targets_distribution(llm, model, prompt: list[int], method: str, n: int = 1200,
                                          temperature: float = 1.0, top_k: int = 3) -> None:
    from decodert.runtime.decoding.sampling import make_distribution
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    dist = make_distribution(temperature, top_k=top_k)

    def probs(ids):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].numpy()[None].astype(np.float32)
        p = dist(row)[0]
        return p / p.sum()

    exact: dict[tuple, float] = {}
    p1 = probs(prompt)
    for a in np.flatnonzero(p1):
        p2 = probs(prompt + [int(a)])
        for b in np.flatnonzero(p2):
            p3 = probs(prompt + [int(a), int(b)])
            for c in np.flatnonzero(p3):
                exact[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    cells = sorted(exact)
    for spec in (None, SpeculativeConfig(method, draft_len=2, adaptive=False)):
        counts = dict.fromkeys(cells, 0)
        for seed in range(n):
            ids = tuple(llm.generate(prompt, seed=seed, speculative=spec, max_new_tokens=3, temperature=temperature,
                                     top_k=top_k).token_ids)
            counts[ids] += 1  # a KeyError: a sequence the target gives no probability
        e = np.array([exact[c] * n for c in cells])
        seen = np.array([counts[c] for c in cells], float)
        keep = e >= 5
        e, seen = np.append(e[keep], e[~keep].sum()), np.append(seen[keep], seen[~keep].sum())
        chi2 = float(((seen - e) ** 2 / np.maximum(e, 1e-9)).sum())
        assert chi2 < 1.5 * len(e) + 25, (spec, chi2, len(e))
