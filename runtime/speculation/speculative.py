"""Speculative decoding: a drafter proposes tokens, one verify pass of the target checks them all.

    row b:  last token t, drafts d1..dk  ->  verify([t, d1..dk])  ->  target choice after each
            accept d1..dm while they equal the target's choice, then the target's own token
            -> m + 1 tokens for one target pass; the cache is set back to length + 1 + m (no copy)

Exactness:
- greedy (with or without penalties): the target's choice at each position is what plain
  decoding would choose there (same logits, same history), so the output is token-for-token the
  same;
- sampling: standard speculative sampling with a one-hot proposal q (both drafters propose one
  token per position): accept d with probability min(1, p(d) / q(d)) = p(d), else draw from the
  normalised residual max(0, p - q) = p without d. p is the target's distribution after the
  same penalties and temperature / top-k / top-p / min-p as plain sampling (runtime/decoding/sampling.py),
  so every emitted token has plain sampling's distribution.

Adaptivity (``adaptive=True``): each row keeps an acceptance estimate per kind of proposal (the
n-gram length for prompt lookup), starting from what earlier rows saw for that kind; a shared
cost table holds the measured seconds of a target pass per (rows, width) (a row count not
measured yet takes a plain step first; a width not measured yet is priced by the measured cost
of one more token). Each step picks the verify width with the most expected tokens per second,
where width 1 is a plain decode step: when acceptance collapses (free-form text), speculation
stops costing anything but the n-gram search. A prompt-lookup draft a plain step did not verify
is judged in hindsight against the tokens generated next, so estimates keep learning while a row
decodes plainly and speculation resumes when the text starts repeating; a draft model's row,
whose drafts cost a pass to ask, drifts back to what all rows saw instead. A draft head also gives
its probability for each draft: calibrated by what the target accepted (planner.Calibration), it
prices the head's first draft and ends each row's chain where one more token is worth less than it
costs (planner.draft_floor).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.heads import HEAD_METHOD_NAMES
from decodert.runtime.speculation.drafters import Drafter, NgramDrafter
from decodert.runtime.speculation.planner import Calibration, StepCosts, chain_tokens, draft_floor, expected_tokens, plan
from decodert.runtime.decoding.generate import Sequence, decode_step
from decodert.runtime.decoding.metrics import Metrics
from decodert.runtime.decoding.sampling import apply_processors, draw, greedy, make_distribution

METHODS = ("ngram", "draft", *HEAD_METHOD_NAMES, "auto")  # the heads': assistant, mtp, eagle3
PRIOR = 0.5  # acceptance of a kind of proposal nobody has verified yet (one pseudo-observation)
HINDSIGHT = 0.25  # weight of a draft judged in hindsight (not verified) against a verified one


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup) | "draft" (LLM.load(..., draft=ARTIFACT)) | "assistant" (a draft head
    that reads the target's hidden states: LLM.load(..., draft=HEAD_ARTIFACT), runtime/speculation/heads.py) |
    "mtp" (a Qwen3.5 MTP head, the same way: runtime/speculation/mtp.py) | "eagle3" (an EAGLE-3 head, the same
    way; each head answers to its own method) |
    "auto" (the head when one is loaded, else the draft model, else prompt lookup); ``draft_len``:
    most tokens drafted per step; ``max_ngram`` / ``min_ngram``: the match lengths prompt lookup
    tries; ``adaptive``: pick the draft length from measured acceptance and step costs;
    ``prompt_lookup`` (a head's rows, adaptive): prompt lookup drafts beside the head, and a step
    verifies whichever of the two drafts promises more tokens a second."""

    method: str = "ngram"
    draft_len: int = 8
    max_ngram: int = 4
    min_ngram: int = 1
    adaptive: bool = True
    prompt_lookup: bool = True

    def validate(self) -> "SpeculativeConfig":
        if self.method not in METHODS:
            raise DecodertError(f"speculative must be one of {', '.join(METHODS)} (or a SpeculativeConfig), "
                                f"got {self.method!r}")
        for name, low in (("draft_len", 1), ("max_ngram", 1), ("min_ngram", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise DecodertError(f"speculative {name} must be an integer >= {low}, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise DecodertError(f"speculative min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}")
        return self


def resolve(value: Any) -> SpeculativeConfig | None:
    """``speculative=`` argument -> config (None, False or "" -> off)."""
    if value is None or value is False or value == "":
        return None
    if isinstance(value, SpeculativeConfig):
        return value.validate()
    if isinstance(value, str):
        return SpeculativeConfig(method=value).validate()
    raise DecodertError(f"speculative must be 'ngram', 'draft' or a SpeculativeConfig, got {type(value).__name__}")


class Speculator:
    """What the rows of one LLM share: the cost table, the drafters and the acceptance seen so far
    per (drafter, kind of proposal), which is where a new row's estimates start."""

    def __init__(self, draft_backend: Any = None, head: Drafter | None = None) -> None:
        self.costs = StepCosts()
        self.seen: dict[tuple[int, int | None], list[float]] = {}  # (id(drafter), kind or None: all) -> [accepted, evaluated], decayed
        self._draft_backend = draft_backend
        self._draft: Drafter | None = None
        self._head = head  # a head's drafter (made at load: the backend keeps hidden states from the first pass)
        self._ngram: dict[tuple[int, int], NgramDrafter] = {}
        self._calibrations: dict[int, Calibration] = {}  # id(head drafter) -> its probability's acceptance
        self._making = threading.Lock()  # requests on server threads ask at once: one drafter (one draft cache) each kind

    def drafter(self, config: SpeculativeConfig) -> Drafter:
        method = config.method
        head_method = getattr(self._head, "method", None)
        if method == "auto":
            method = head_method or ("draft" if self._draft_backend is not None else "ngram")
        if method in HEAD_METHOD_NAMES:
            if self._head is None:
                raise DecodertError(f"speculative='{method}' needs a draft head: LLM.load(path, draft=HEAD_ARTIFACT) "
                                    "(--draft; export one with `decodert export HEAD --target-artifact TARGET`)")
            if method != head_method:
                raise DecodertError(f"speculative='{method}' does not draft with the loaded head; it is a "
                                    f"speculative='{head_method}' head")
            return self._head
        if method == "ngram":
            return self.lookup(config)
        with self._making:
            if self._draft_backend is None:
                raise DecodertError("speculative='draft' needs a draft model: LLM.load(path, draft=ARTIFACT) (--draft)")
            if self._draft is None:
                from decodert.runtime.speculation.drafters import DraftModelDrafter

                self._draft = DraftModelDrafter(self._draft_backend)
            return self._draft

    def lookup(self, config: SpeculativeConfig) -> NgramDrafter:
        """The prompt-lookup drafter of ``config``'s match lengths (one per lengths, shared by every row)."""
        key = (config.max_ngram, config.min_ngram)
        with self._making:
            if key not in self._ngram:
                self._ngram[key] = NgramDrafter(*key)
            return self._ngram[key]

    def calibration(self, drafter: Drafter) -> Calibration:
        """How often ``drafter``'s drafts are accepted given its probability for them (a head's; every row's)."""
        got = self._calibrations.get(id(drafter))
        if got is None:
            got = self._calibrations[id(drafter)] = Calibration()
        return got

    def state(self, config: SpeculativeConfig, seq: Sequence) -> "RowState":
        return RowState(self, config, self.drafter(config), seq)

    def prior(self, drafter: Drafter, key: int) -> float:
        """Acceptance every row has seen for this kind of proposal, with what they saw for every
        kind of this drafter counted as one observation (and PRIOR as one of that): a kind not
        verified yet starts from the drafter's record, so on free-form text, where every kind
        fails, a new kind is not tried as if it were right half the time."""
        pooled_acc, pooled_seen = self.seen.get((id(drafter), None), (0.0, 0.0))
        acc, seen = self.seen.get((id(drafter), key), (0.0, 0.0))
        return (acc + (pooled_acc + PRIOR) / (pooled_seen + 1.0)) / (seen + 1.0)

    def observe(self, drafter: Drafter, key: int, accepted: float, evaluated: float, weight: float = 1.0) -> None:
        """Add one outcome (``weight``: a hindsight one counts less, and ages the record less)."""
        keep = 1 - 0.02 * weight
        for k in (key, None):  # None: every kind of this drafter
            acc, seen = self.seen.get((id(drafter), k), (0.0, 0.0))
            self.seen[(id(drafter), k)] = [keep * acc + weight * accepted, keep * seen + weight * evaluated]


class RowState:
    """One row's speculation: its config, drafter, acceptance estimates and counters (``seq.spec``)."""

    def __init__(self, speculator: Speculator, config: SpeculativeConfig, drafter: Drafter, seq: Sequence) -> None:
        self.speculator, self.config, self.drafter = speculator, config, drafter
        p = seq.params
        self.distribution = None if p.greedy else make_distribution(p.temperature, p.top_k, p.top_p, p.min_p)
        self.stats: dict[int, list[float]] = {}  # proposal kind -> [accepted, evaluated] (decayed sums)
        self.passes = self.proposed = self.accepted = 0
        self.pending: list[tuple[int, int, list[int], list[float] | None]] = []  # (kind, first position, draft,
        # a head's probability of each) not verified yet
        self.confidence: np.ndarray | None = None  # a head's probability of each draft of this step's pass
        self.at: tuple[Any, int] | None = None  # (target cache, slot) of the row this step

    def acceptance(self, key: int) -> float:
        acc, seen = self.stats.get(key) or (self.speculator.prior(self.drafter, key), 1.0)
        return acc / seen

    def learn(self, key: int, proposed: int, accepted: int, weight: float = 1.0) -> None:
        """Add a verified outcome (``weight`` 1), or a hindsight one (``HINDSIGHT``): those come at
        every plain step and overlap (step t's draft and step t+1's share tokens), so each counts
        for less and the row's record forgets more slowly (at a verified pass's weight its estimate
        jumped with every lucky match, and a noisy row verified one step in four)."""
        acc, seen = self.stats.get(key) or [self.speculator.prior(self.drafter, key), 1.0]
        evaluated = accepted + (accepted < proposed)  # drafts compared up to the first rejection
        keep = 1 - 0.3 * weight
        self.stats[key] = [keep * acc + weight * accepted, keep * seen + weight * evaluated]
        self.speculator.observe(self.drafter, key, accepted, evaluated, weight)

    def remember(self, key: int, start: int, draft: np.ndarray, probs: Seq[float] | None = None) -> None:
        """A draft for positions ``start``.. that this step did not verify (prompt lookup's, or the first
        token a following head would draft, with the head's ``probs`` for it): judged in hindsight
        (``hindsight``) once the row has generated those positions."""
        self.pending.append((key, start, draft.tolist(), None if probs is None else list(probs)))

    def calibrate(self, probs: Seq[float], accepted: int, evaluated: int) -> None:
        """A head's drafts with these probabilities: the first ``evaluated`` were compared with the target's
        tokens, the first ``accepted`` of them kept (``Calibration``)."""
        calibration = self.speculator.calibration(self.drafter)
        for i in range(min(evaluated, len(probs))):
            calibration.observe(float(probs[i]), i < accepted)

    def hindsight(self, seq: Sequence) -> None:
        """Learn from the remembered drafts the generated tokens now settle: how many of each a
        verify pass would have kept (greedy: exactly; sampling: a draft token equals the sampled
        one with the probability speculative sampling accepts it). So a row that decodes plainly
        keeps learning, and a kind of proposal that failed on earlier text is drafted again as
        soon as it starts to be right (before, its estimate stayed where it was, and a reply that
        repeated itself was decoded plainly to the end)."""
        keep = []
        for key, start, draft, probs in self.pending:
            known = seq.history[start : min(seq.length, start + len(draft))].tolist()
            hit = next((i for i, (a, b) in enumerate(zip(known, draft)) if a != b), len(known))
            if hit < len(known) or len(known) == len(draft):
                self.learn(key, len(draft), hit, HINDSIGHT)
                if probs is not None:  # exact for greedy rows, as a verify would judge it for sampled ones
                    self.calibrate(probs, hit, hit + (hit < len(draft)))
            elif not seq.done:
                keep.append((key, start, draft, probs))
        self.pending = keep

    def idle(self, key: int) -> None:
        """A draft of this kind was available but not verified: drift towards what all rows saw."""
        prior = self.speculator.prior(self.drafter, key)
        acc, seen = self.stats.get(key) or [prior, 1.0]
        self.stats[key] = [0.97 * acc + 0.03 * prior, 0.97 * seen + 0.03]

    def annotate(self, metrics: Metrics) -> Metrics:
        per_step = (metrics.generated_tokens - 1) / self.passes if self.passes else 0.0
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return dataclasses.replace(metrics, accepted_per_step=per_step, acceptance_rate=rate)


# ---- the step ----------------------------------------------------------------------------------
def step(backend: Any, cache: Any, slots: Seq[int], seqs: Seq[Sequence], drain: bool = False) -> list[str]:
    """One decode step of rows that may speculate (``seq.spec``) -> one text delta per row (all
    the tokens the row committed in this step). ``drain``: no request waits for a slot, so the
    step that matters is the one that brings the last row's end nearer (see ``planner.plan``)."""
    spec_rows = [j for j, s in enumerate(seqs) if s.spec is not None]
    speculator: Speculator = seqs[spec_rows[0]].spec.speculator
    for j in spec_rows:
        if seqs[j].spec.pending:
            seqs[j].spec.hindsight(seqs[j])
    width_max = int(getattr(backend, "verify_width", 0) or 0)
    if not getattr(backend, "verify_matches_decode", True):  # its verify would not give the plain step's tokens
        width_max = 0
    if width_max:
        backend.prepare_verify(len(seqs))  # open it now, not inside the first pass the plan picks
    for slot, s in zip(slots, seqs):  # where a drafter that reads the target's rows finds them (runtime/speculation/heads.py)
        if s.spec is not None:
            s.spec.at = (cache, slot)
    limits = [_row_limit(s, width_max) if s.spec is not None else 0 for s in seqs]
    # row -> (the first draft its head would propose now, the head's probability): judged in hindsight if not asked
    firsts: dict[int, tuple[int, float]] = {}
    for drafter, members in _by_drafter(seqs, limits).items():  # a head with a K/V of its own follows every pass
        if hasattr(drafter, "follow"):
            got = drafter.follow([seqs[j] for j in members])
            firsts.update((members[i], first) for i, first in got.items())
    drafts, keys = _look(seqs, limits)
    first = [speculator.calibration(seqs[j].spec.drafter)(firsts[j][1]) if j in firsts else None
             for j in range(len(seqs))]
    beside = _beside_the_head(speculator, seqs, limits, drafts, keys, first)  # row -> its lookup, where it won
    lookups = {j: got for j, got in beside.items() if got is not None}
    width, tokens_per_second = plan(speculator.costs, seqs, drafts, keys, limits, drain, first)
    n = len(seqs)
    if width == 1:  # plain decode step
        for j in spec_rows:
            seqs[j].spec.passes += 1
            if j in beside:  # a head row that looked up: its lookup judged in hindsight, then its head's draft
                draft, kind = beside[j] or (drafts[j], keys[j])
                seqs[j].spec.remember(kind, seqs[j].length, draft)
                keys[j] = None
            if keys[j] is not None and len(drafts[j]):  # prompt lookup: judged once the tokens are known
                seqs[j].spec.remember(keys[j], seqs[j].length, drafts[j])
            elif j in firsts:  # a head that followed the pass: its first draft judged once the step settles it
                seqs[j].spec.remember(1, seqs[j].length, np.array([firsts[j][0]], np.int64), [firsts[j][1]])
            elif keys[j] is None and limits[j]:  # a model drafter was not asked: drift to what rows saw
                seqs[j].spec.idle(1)
        t0 = time.perf_counter()
        deltas = decode_step(backend, cache, slots, seqs)
        speculator.costs.record(n, 1, time.perf_counter() - t0)
        return deltas
    drafts = _draft(seqs, drafts, keys, limits, width, tokens_per_second)
    for j, (token, prob) in firsts.items():  # a head row that verifies no draft of its head: judged later
        if not len(drafts[j]) or keys[j] is not None:
            seqs[j].spec.remember(1, seqs[j].length, np.array([token], np.int64), [prob])
    for j, (draft, kind) in lookups.items():  # a lookup the head's draft beat: judged later
        if keys[j] is None:
            seqs[j].spec.remember(kind, seqs[j].length, draft)
    drafts = [d[: s.guide.check(d)] if s.guide is not None and len(d) else d  # cut what the grammar rejects
              for s, d in zip(seqs, drafts)]
    ids = [np.concatenate([[s.last_token], d]).astype(np.int64) for s, d in zip(seqs, drafts)]
    want = any(s.needs_logits for s in seqs)
    t0 = time.perf_counter()
    for slot in slots:  # a hybrid model's states before the pass, to go back to (no-op for K/V alone)
        cache.snapshot(slot)
    out = backend.verify(cache, list(slots), ids, want_logits=want)
    verified = time.perf_counter() - t0
    deltas: list[str] = []
    replay: list[tuple[int, np.ndarray]] = []  # (slot, ids to run again): hybrid rows that rejected a draft
    for j, (slot, seq) in enumerate(zip(slots, seqs)):
        logits = out.logits[j] if out.logits is not None else None
        text, accepted = _commit(seq, drafts[j], out.next_tokens[j], logits)
        deltas.append(text)
        _rewind(cache, slot, seq, replay, len(ids[j]), out.windows[j] if out.windows is not None else None)
        if seq.spec is not None:
            _learn(seq, keys[j], len(drafts[j]), accepted)
    if replay:  # part of the pass's price: the planner weighs it (hybrid models only)
        rows = getattr(backend, "hidden_rows", None)  # a draft head's: the verify's rows of the replayed positions
        verify_rows = {slot: rows.span(slot) for slot, _ in replay} if rows is not None else {}
        t0 = time.perf_counter()
        backend.prefill(cache, [slot for slot, _ in replay], [ids for _, ids in replay], want_logits=False)
        verified += time.perf_counter() - t0
        for slot, got in verify_rows.items():
            if got is not None:
                rows.prepend(slot, *got)
    speculator.costs.record(n, max(len(x) for x in ids), verified)
    return deltas


def _rewind(cache: Any, slot: int, seq: Sequence, replay: list, fed: int, windows: dict | None) -> None:
    """Drop the rejected drafts (finished or not): the row holds history[:length - 1]. A row with
    conv / recurrent states cannot be cut at a position (docs/SPECULATIVE.md): with the pass's conv
    ``windows`` it takes the states after the accepted tokens from them; else it goes back to its
    pre-verify snapshot and the accepted tokens are run again (appended to ``replay``)."""
    to, n = seq.length - 1, int(cache.lengths[slot])
    if windows and to < n:
        accepted = to - (n - fed)  # of the ``fed`` tokens of the pass
        cache.rewind(slot, to, {name: w[:, accepted : accepted + w.shape[1] - fed] for name, w in windows.items()})
        return
    back = cache.rewind_point(slot, to)
    cache.rewind(slot, back)
    if back < to:
        replay.append((slot, np.asarray(seq.history[back:to], np.int64)))


def _row_limit(seq: Sequence, width_max: int) -> int:
    """Most drafts worth verifying for ``seq``: the config, the verify width, the cache room
    (positions length-1 .. length-1+k are written) and the tokens still to generate."""
    left = seq.params.max_new_tokens - len(seq.generated) - 1
    return max(0, min(seq.spec.config.draft_len, width_max - 1, seq.max_seq - seq.length, left))


def _look(seqs: Seq[Sequence], limits: list[int]) -> tuple[list[np.ndarray], list[int | None]]:
    """Drafts of the drafters that cost nothing to ask (prompt lookup); None keys: ask later."""
    drafts = [np.zeros(0, np.int64) for _ in seqs]
    keys: list[int | None] = [0] * len(seqs)
    for drafter, rows in _by_drafter(seqs, limits).items():
        if isinstance(drafter, NgramDrafter):  # free to ask before planning
            got, kinds = drafter.propose([seqs[j] for j in rows], [limits[j] for j in rows])
            for j, d, kind in zip(rows, got, kinds):
                drafts[j], keys[j] = d, kind
        else:
            for j in rows:
                keys[j] = None
    return drafts, keys


def _beside_the_head(speculator: Speculator, seqs: Seq[Sequence], limits: list[int], drafts: list[np.ndarray],
                     keys: list[int | None], first: list[float | None]) -> dict[int, tuple[np.ndarray, int] | None]:
    """Prompt lookup for a head's rows (``prompt_lookup``, adaptive, a head that followed the pass): where the
    lookup's draft, at its kind's acceptance and no head call, promises more tokens a second than the head's
    chain (its first draft's calibrated chance, then the row's acceptance, a head call per later token), the
    row verifies it (``drafts`` / ``keys`` / ``first`` set in place, as prompt lookup's rows). -> row -> (its lookup, kind)
    where the head's draft won, None where the lookup did, for every head row that looked up; the draft not
    verified is judged in hindsight. On text that repeats itself lookup drafts are long and right; on free
    text the head is the better guess."""
    out: dict[int, tuple[np.ndarray, int] | None] = {}
    n = len(seqs)
    base = speculator.costs.estimate(n, 1)
    rows = [j for j, s in enumerate(seqs) if s.spec is not None and keys[j] is None and first[j] is not None
            and limits[j] > 0 and s.spec.config.prompt_lookup and s.spec.config.adaptive]
    if base is None or not rows:
        return out
    got, kinds = speculator.lookup(seqs[rows[0]].spec.config).propose([seqs[j] for j in rows], [limits[j] for j in rows])
    widest = max(max(limits[j], len(d)) for j, d in zip(rows, got))
    seconds = {w: speculator.costs.estimate(n, w) or base for w in range(2, widest + 2)}  # a pass of width w

    def best(tokens: Any, most: int, calls: Any) -> float:
        return max(tokens(k) / (seconds[k + 1] + calls(k)) for k in range(1, most + 1))

    for j, draft, kind in zip(rows, got, kinds):
        if not len(draft):
            continue
        spec = seqs[j].spec
        head_a, look_a, cost = spec.acceptance(1), spec.acceptance(kind), spec.drafter.seconds_per_token

        head = best(lambda k: chain_tokens(first[j], head_a, k), limits[j], lambda k: cost * (k - 1))
        look = best(lambda k: expected_tokens(look_a, k), len(draft), lambda k: 0.0)
        if look > head:
            drafts[j], keys[j], first[j] = draft, kind, None  # the head's first draft no longer prices the pass
            out[j] = None
        else:
            out[j] = (draft, kind)
    return out


def _by_drafter(seqs: Seq[Sequence], limits: list[int]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for j, s in enumerate(seqs):
        if s.spec is not None and limits[j] > 0:
            groups.setdefault(s.spec.drafter, []).append(j)
    return groups


def _draft(seqs: Seq[Sequence], drafts: list[np.ndarray], keys: list[int | None], limits: list[int],
           width: int, tokens_per_second: float = 0.0) -> list[np.ndarray]:
    """Cut looked-up drafts to the width; ask the model drafters for theirs. A head that says how sure it
    is (``confidences``) ends a row's chain where one more token's calibrated chance of acceptance is
    below what it costs at the plan's rate (planner.draft_floor; adaptive rows only)."""
    out = [d[: width - 1] for d in drafts]
    for drafter, rows in _by_drafter(seqs, limits).items():
        rows = [j for j in rows if keys[j] is None]
        if not rows:
            continue
        sure = hasattr(drafter, "confidences")
        keep = None
        if sure and tokens_per_second > 0 and all(seqs[j].spec.config.adaptive for j in rows):
            speculator = seqs[rows[0]].spec.speculator
            calibration = speculator.calibration(drafter)
            floor = draft_floor(speculator.costs, len(seqs), tokens_per_second, drafter.seconds_per_token)
            keep = lambda probs: calibration.chain(probs) >= floor  # noqa: E731
        asked, ask = [seqs[j] for j in rows], [min(limits[j], width - 1) for j in rows]
        got, _ = drafter.propose(asked, ask) if keep is None else drafter.propose(asked, ask, keep=keep)
        for i, (j, d) in enumerate(zip(rows, got)):
            out[j] = d
            seqs[j].spec.confidence = drafter.confidences[i] if sure else None
    return out


def _commit(seq: Sequence, drafts: np.ndarray, next_tokens: np.ndarray, logits: np.ndarray | None) -> tuple[str, int]:
    """Accept ``seq``'s drafts [k] against the target's output at each position (next_tokens
    [W], logits [W, V]) -> (text delta, drafts accepted). Stops at the first rejection, a stop or
    eos token, a stop string, max_new_tokens or a full cache (seq.accept decides)."""
    text, k = "", len(drafts)
    for i in range(k + 1):
        draft = int(drafts[i]) if i < k else None
        token = _choose(seq, int(next_tokens[i]), None if logits is None else logits[i], draft)
        text += seq.accept(token)
        if seq.done or token != draft:
            return text, i + (token == draft)
    return text, k


def _choose(seq: Sequence, argmax: int, logits: np.ndarray | None, draft: int | None) -> int:
    """The target's token at one position: plain decoding's choice (greedy), or speculative
    sampling's (draft accepted with probability p(draft), else a draw from p without it)."""
    if not seq.needs_logits:  # the graph's argmax; over NaN / inf scores (their logits given) greedy's choice
        return argmax if logits is None or np.isfinite(logits[argmax]) else int(greedy(logits[None, :])[0])
    assert logits is not None
    spec = seq.spec
    if seq.params.greedy or spec is None or spec.distribution is None:
        return seq.choose(logits, argmax)
    if seq.guide is not None:  # structured output: the mask at this position (the guide has advanced to it)
        logits = seq.guide.mask_logits(logits)
    row = apply_processors(seq.processors, seq.history[: seq.length], logits[None, :])  # [1, V]
    probs = spec.distribution(row)  # [1, V] unnormalised
    if draft is not None:
        p_draft = probs[0, draft] / probs[0].sum()
        if seq.rng.random() < p_draft:
            return seq.fit(draft)
        probs = probs.copy()
        probs[0, draft] = 0.0  # the residual max(0, p - onehot(draft)), normalised by the draw
    return seq.fit(int(draw(probs, seq.rng)[0]))


def _learn(seq: Sequence, key: int | None, proposed: int, accepted: int) -> None:
    spec = seq.spec
    spec.passes += 1
    spec.proposed += proposed
    spec.accepted += accepted
    if proposed:
        spec.learn(key if key is not None else 1, proposed, accepted)
        if spec.confidence is not None:  # drafts after a finished row's end were not compared
            spec.calibrate(spec.confidence[:proposed], accepted, accepted + (accepted < proposed and not seq.done))
    spec.confidence = None
    if seq.done:
        spec.drafter.release(seq)
