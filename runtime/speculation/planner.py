"""The speculation planner: measured costs of target passes, and the verify width worth running.

Each step picks the verify width (1: a plain decode step) with the most expected tokens per
second, from the rows' acceptance estimates (runtime/speculation/speculative.py) and the measured
seconds of a target pass per (rows, width); see ``plan``. A draft head also says how sure it is of
each token it drafts (its probability): ``Calibration`` turns that into the chance the target
accepts the token, measured as the rows go, and a row's chain of drafts ends where one more token
would add less than it costs (``draft_floor``).
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import numpy as np

SLOPE_PRIOR = 0.1  # cost of one more verified token per row, in decode steps, before any is measured


class StepCosts:
    """Measured seconds of one target pass per (rows, width); width 1 = decode.

    The estimate of a shape is the lower quartile of its last ``WINDOW`` passes: on a shared
    machine the noise only ever adds time, and a moving average kept one slow decode step for
    the rest of a batch (speculation then ran every step, so decode steps, the only ones that
    could correct it, never came back). The first pass of each shape is not recorded (it pays
    for warm-up: session creation, JIT)."""

    WINDOW = 8

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int], float] = {}  # (rows, width) -> the estimate
        self._recent: dict[tuple[int, int], list[float]] = {}

    def record(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        recent = self._recent.get(key)
        if recent is None:
            self._recent[key] = []
            return
        recent.append(seconds)
        del recent[: -self.WINDOW]
        self.seconds[key] = sorted(recent)[(len(recent) - 1) // 4]

    def estimate(self, rows: int, width: int) -> float | None:
        """Seconds, or None when nothing of this row count was measured. An unmeasured width scales
        the nearest measured one by the measured cost of an extra token (``slope``). A wider pass
        is never priced below a decode step of as many rows."""
        known = [w for r, w in self.seconds if r == rows]
        if not known:
            return None
        if (rows, width) in self.seconds:
            got = self.seconds[(rows, width)]
        else:
            near = min(known, key=lambda w: abs(w - width))
            slope = self.slope(rows)
            got = self.seconds[(rows, near)] * (1 + slope * (width - 1)) / (1 + slope * (near - 1))
        decode = self.seconds.get((rows, 1))
        return got if decode is None or width == 1 else max(got, decode)

    def slope(self, rows: int) -> float:
        """Cost of one more token per row, as a fraction of a decode step of as many rows: the mean
        over the measured verify widths of this row count (else of every row count; else a prior:
        a CPU that is compute-bound pays 0.3-0.5 per token at int4, a bandwidth-bound one less)."""
        def ratios(same_rows: bool) -> list[float]:
            return [(s / self.seconds[(n, 1)] - 1) / (w - 1) for (n, w), s in self.seconds.items()
                    if w > 1 and (n, 1) in self.seconds and (n == rows or not same_rows)]
        measured = ratios(True) or ratios(False)
        return max(0.0, sum(measured) / len(measured)) if measured else SLOPE_PRIOR


class Calibration:
    """How often the target accepts a head's draft, given the head's probability ``p`` for it (its softmax
    maximum; the chance of a draft whose earlier drafts were accepted). Decayed counts per tenth of ``p``,
    each starting as two observations at the tenth's middle: a new head is taken at its word, then
    corrected (SmolLM2's trained head: drafts it gave 0.8-1 were accepted 74% of the time, 0-0.2 9%)."""

    BINS = 10
    KEEP = 0.995  # an observation ages the counts of its tenth by this

    def __init__(self) -> None:
        mids = (np.arange(self.BINS) + 0.5) / self.BINS
        self.accepted, self.seen = 2.0 * mids, np.full(self.BINS, 2.0)

    def _bin(self, p: float) -> int:
        return min(int(p * self.BINS), self.BINS - 1) if p > 0 else 0

    def __call__(self, p: float) -> float:
        b = self._bin(p)
        return float(self.accepted[b] / self.seen[b])

    def chain(self, probs: Seq[float]) -> float:
        """The chance that drafts with these probabilities are all accepted (the last one is reached)."""
        return float(np.prod([self(p) for p in probs])) if len(probs) else 1.0

    def observe(self, p: float, accepted: bool) -> None:
        b = self._bin(p)
        self.accepted[b] = self.KEEP * self.accepted[b] + float(accepted)
        self.seen[b] = self.KEEP * self.seen[b] + 1.0


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify of k drafts commits when each is accepted with probability a: sum a^i, i=0..k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def chain_tokens(first: float | None, a: float, k: int) -> float:
    """``expected_tokens`` where the first draft's chance is known apart (``first``: a head's calibrated
    probability for the draft it has made already) and the later ones' is ``a``."""
    if first is None or k == 0:
        return expected_tokens(a, k)
    return 1.0 + first * expected_tokens(a, k - 1)


def draft_floor(costs: StepCosts, n: int, tokens_per_second: float, draft_seconds: float) -> float:
    """The least chance of acceptance for which one more drafted token pays, in a pass of ``n`` rows that
    commits ``tokens_per_second``: the token adds its chance of acceptance, and costs one more verified
    position (the measured slope of ``n`` rows) and one head call; worth it while chance / cost beats the
    plan's tokens per second."""
    base = costs.estimate(n, 1)
    if base is None or tokens_per_second <= 0:
        return 0.0
    return tokens_per_second * (costs.slope(n) * base + draft_seconds)


def plan(costs: StepCosts, seqs: Seq[Any], drafts: list[np.ndarray], keys: list[int | None],
         limits: list[int], drain: bool = False, first: Seq[float | None] | None = None) -> tuple[int, float]:
    """(verify width (1 = plain decode) with the most expected tokens per second, or, when ``drain``
    (nothing waits for a slot), the one that ends the batch soonest; the expected tokens per second of
    that width, 0 where nothing is measured or the rows do not adapt). ``drain``: the rows' time to
    their token limit at this step's rate is ``seconds * max(left / tokens)``. A row that races
    ahead then frees a slot nobody takes, so its tokens are only worth a wider pass when it is
    the one the batch waits for (free-form rows beside one that repeats itself: batch 4 spent 37
    of 126 passes verifying for the one row and finished no sooner). ``first``: per row, the chance
    its first draft is accepted where a head has drafted it already (``chain_tokens``)."""
    avail = [len(d) if keys[j] is not None else limits[j] for j, d in enumerate(drafts)]  # [n]
    if max(avail, default=0) == 0:
        return 1, 0.0
    if not all(s.spec.config.adaptive for s in seqs if s.spec is not None):
        return max(avail) + 1, 0.0
    n = len(seqs)
    base = costs.estimate(n, 1)
    if base is None:
        return 1, 0.0  # no decode step of this many rows measured yet: take one (cheap), then price widths
    first = list(first) if first is not None else [None] * n
    acc = [s.spec.acceptance(keys[j] if keys[j] is not None else 1) if s.spec is not None else 0.0
           for j, s in enumerate(seqs)]
    draft_cost = [s.spec.drafter.seconds_per_token if s.spec is not None else 0.0 for s in seqs]
    left = [max(1, s.params.max_new_tokens - len(s.generated)) for s in seqs] if drain and n > 1 else None

    def rate(tokens: list[float], seconds: float) -> float:
        return sum(tokens) / seconds if left is None else 1 / (seconds * max(r / t for r, t in zip(left, tokens)))

    best, best_rate, best_tps = 1, rate([1.0] * n, base), n / base
    for width in range(2, max(avail) + 2):
        ks = [min(a, width - 1) for a in avail]
        tokens = [chain_tokens(f, a, k) for f, a, k in zip(first, acc, ks)]
        # a head's first draft is made already (it followed the pass): only the later ones cost a call
        seconds = (costs.estimate(n, width) or base) + sum(c * max(k - (f is not None), 0)
                                                           for c, k, f in zip(draft_cost, ks, first))
        if (got := rate(tokens, seconds)) > best_rate:
            best, best_rate, best_tps = width, got, sum(tokens) / seconds
    return best, best_tps
