"""Drafters for speculative decoding: who proposes the tokens the target model then verifies.

One small interface (``Drafter``): ``propose(seqs, limits)`` returns up to ``limits[j]`` draft
ids per row (may be empty) and a key naming the kind of proposal (the acceptance of each kind
is tracked apart: a 4-token n-gram match is right more often than a 1-token one);
``release(seq)`` forgets a finished row. A draft head (runtime/speculation/heads.py, mtp.py) also
takes ``propose(..., keep=)`` and leaves its probability of each draft in ``confidences``
(speculative.py's confidence rule).

- ``NgramDrafter`` (prompt lookup): the longest suffix of the row's tokens (prompt + generated,
  ``max_ngram`` down to ``min_ngram`` tokens) that occurred before; the tokens that followed it
  are the draft, voted position by position where it occurred several times (the most recent
  occurrence on a tie). Its kind of proposal is the match length and whether the occurrences
  agree (``ngram_kind``). No model, no state.
- ``DraftModelDrafter``: a second decodert artifact with the same tokenizer proposes its greedy
  tokens (q one-hot, so the acceptance rule is the same as for prompt lookup). It keeps one
  cache slot per row; at each proposal that row is rewound to the longest beginning of the row's
  history it holds (its rejected drafts go) and fed the rest (the target's correction).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Protocol, Sequence as Seq

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.backends.kv_cache import common_prefix


class Drafter(Protocol):
    seconds_per_token: float  # measured cost of drafting one token (0 for prompt lookup)

    def propose(self, seqs: Seq[Any], limits: Seq[int]) -> tuple[list[np.ndarray], list[int]]:
        """(drafts: [k_j] int64 per row with k_j <= limits[j], key per row for acceptance stats)."""
        ...

    def release(self, seq: Any) -> None:
        ...


def end_chains(ends: np.ndarray, probs: np.ndarray, step: int, keep: Callable[[np.ndarray], bool] | None) -> bool:
    """A head's chains after it drafted token ``step`` of each row (``probs`` [rows, > step]: its probability of
    each draft): a row whose draft ``step`` is not worth verifying (``keep(probs[row, :step + 1])`` false) ends
    before it (``ends`` [rows], the drafts each row keeps, set in place). True while a row wants a draft after
    ``step``."""
    if keep is not None:
        for i in range(len(ends)):
            if ends[i] > step and not keep(probs[i, : step + 1]):
                ends[i] = step
    return bool((ends > step + 1).any())


def suffix_matches(history: np.ndarray, max_n: int, min_n: int) -> tuple[np.ndarray, int]:
    """(continuation starts [c], n) of every earlier occurrence of the last n tokens of ``history``
    [L], for the longest n <= max_n that occurs; (empty, 0) if no occurrence of at least ``min_n``
    tokens exists."""
    length = len(history)
    none = np.zeros(0, np.int64), 0
    if length < 2:
        return none
    ends = np.flatnonzero(history[: length - 1] == history[length - 1]) + 1  # [c] continuation starts
    if ends.size == 0:
        return none
    n = np.ones(ends.size, np.int64)  # [c] matched tokens so far
    alive = np.ones(ends.size, bool)
    for t in range(1, min(max_n, length - 1)):
        back = ends - 1 - t  # [c] position compared with history[length - 1 - t]
        ok = alive & (back >= 0)
        ok[ok] = history[back[ok]] == history[length - 1 - t]
        n += ok
        alive = ok
        if not alive.any():
            break
    best = int(n.max())
    return (ends[n == best], best) if best >= min_n else none


def longest_suffix_match(history: np.ndarray, max_n: int, min_n: int) -> tuple[int, int]:
    """(start of the continuation, n) of the most recent of the longest earlier occurrences of the
    last n tokens of ``history`` (n <= max_n); (-1, 0) if none of at least ``min_n`` tokens."""
    starts, n = suffix_matches(history, max_n, min_n)
    return (int(starts[-1]), n) if n else (-1, 0)


_VOTE_NUMPY = 256  # occurrences past which the vote runs in numpy


def voted_continuation(history: np.ndarray, starts: np.ndarray, k: int) -> np.ndarray:
    """Up to ``k`` tokens continuing the occurrences that start at ``starts`` [c]: at each position
    the token most of the occurrences still agreeing continue with (the most recent one's on a
    tie), so three earlier "for i in range(" followed by "n" beat one followed by "len".

    Plain Python over the few occurrences a match usually has (a numpy pass per position cost
    ~140 us per row and step at k=8, 2.4% of a batch-4 decode step); numpy past ``_VOTE_NUMPY``."""
    if starts.size == 1:
        return history[int(starts[0]) : int(starts[0]) + k].copy()
    if starts.size > _VOTE_NUMPY:
        return _voted_numpy(history, starts, k)
    length = len(history)
    alive = sorted(starts.tolist())  # ascending: the last vote for a token is its latest start
    base = alive[0]
    window = history[base : min(alive[-1] + k, length)].tolist()
    out: list[int] = []
    for i in range(k):
        alive = [s for s in alive if s + i < length]
        if len(alive) <= 1:
            if alive:
                out += window[alive[0] + i - base : alive[0] + k - base]
            break
        votes: dict[int, tuple[int, int]] = {}  # token -> (occurrences, the latest one's start)
        for s in alive:
            token = window[s + i - base]
            count, _ = votes.get(token, (0, 0))
            votes[token] = (count + 1, s)  # ascending starts: s is the latest so far
        pick = max(votes, key=votes.__getitem__)  # most votes, then the most recent
        out.append(pick)
        alive = [s for s in alive if window[s + i - base] == pick]
    return np.array(out, np.int64)


def _voted_numpy(history: np.ndarray, starts: np.ndarray, k: int) -> np.ndarray:
    out = []
    for i in range(k):
        starts = starts[starts + i < len(history)]
        if starts.size == 0:
            break
        tokens, which = np.unique(history[starts + i], return_inverse=True)
        latest = np.zeros(tokens.size, np.int64)
        np.maximum.at(latest, which, starts)
        pick = int(np.lexsort((latest, np.bincount(which)))[-1])  # most votes, then the most recent
        out.append(tokens[pick])
        starts = starts[which == pick]
    return np.array(out, np.int64)


def ngram_kind(history: np.ndarray, starts: np.ndarray, n: int, draft: np.ndarray) -> int:
    """The kind of a prompt-lookup proposal (its acceptance is tracked apart): 4n + 1 where the
    n-gram occurred once, 4n + 2 where its occurrences continue with different tokens, 4n + 3
    where they all continue with the draft's first token; 0 without a match. Agreeing occurrences
    are right far more often than split ones, so the planner drafts long for the one, short or
    not at all for the other (docs/benchmarks/history.md, "Speculative decoding: fourth and fifth sessions":
    +3% grounded tok/s over keying on n alone)."""
    if n == 0 or len(draft) == 0:
        return 0
    if starts.size == 1:
        return 4 * n + 1
    return 4 * n + (3 if bool(np.all(history[starts] == draft[0])) else 2)


class NgramDrafter:
    """Prompt lookup: the continuation of the longest earlier match of the row's last tokens (its
    occurrences vote where there are several)."""

    seconds_per_token = 0.0

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs: Seq[Any], limits: Seq[int]) -> tuple[list[np.ndarray], list[int]]:
        drafts, keys = [], []
        for seq, limit in zip(seqs, limits):
            history = seq.history[: seq.length]  # [L] prompt + generated
            starts, n = suffix_matches(history, self.max_ngram, self.min_ngram) if limit > 0 else (None, 0)
            draft = voted_continuation(history, starts, limit) if n else np.zeros(0, np.int64)
            drafts.append(draft)
            keys.append(ngram_kind(history, starts, n, draft) if n else 0)
        return drafts, keys

    def release(self, seq: Any) -> None:
        pass


class DraftModelDrafter:
    """Greedy drafts from a second (smaller, or more quantized) model with the same tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cache = backend.allocate(int(backend.max_batch))
        self.slot_of: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.seconds_per_token = 0.0  # EMA, measured

    def _slot(self, seq: Any) -> int:
        slot = self.slot_of.get(seq)
        if slot is None:
            for done in [s for s in self.slot_of if s.done]:
                self.release(done)
            free = sorted(set(range(self.cache.slots)) - set(self.slot_of.values()))
            if not free:
                raise DecodertError(f"the draft model has {self.cache.slots} cache slots (its --max-batch); "
                                    "export it with at least the target's --max-batch")
            slot = self.slot_of[seq] = free[0]
            self.cache.reset(slot)
        return slot

    def propose(self, seqs: Seq[Any], limits: Seq[int]) -> tuple[list[np.ndarray], list[int]]:
        room = self.backend.max_seq  # the draft cache holds the row's tokens but the last, then k - 1 drafts
        limits = [min(k, room - seq.length) for seq, k in zip(seqs, limits)]
        rows = [j for j, k in enumerate(limits) if k > 0]
        drafts = [np.zeros(0, np.int64) for _ in seqs]
        if not rows:
            return drafts, [0] * len(seqs)
        t0 = time.perf_counter()
        slots = [self._slot(seqs[j]) for j in rows]
        # The draft row keeps the longest beginning of the row's history it holds (its accepted drafts
        # too), at most all but the last token; it is fed the rest, ending with the row's last token.
        feed = []
        for j, s in zip(rows, slots):
            history = seqs[j].history[: seqs[j].length]
            same = common_prefix(self.cache.held(s), history, len(history) - 1)
            self.cache.rewind(s, self.cache.rewind_point(s, same))
            feed.append(history[int(self.cache.lengths[s]) :])
        out = self.backend.prefill(self.cache, slots, feed, want_logits=False)
        for s in slots:  # a hybrid draft model: its states here, where the next proposal resumes (no-op for K/V)
            self.cache.snapshot(s)
        tokens = [[int(t)] for t in out.next_token]
        catch_up = max(len(f) for f in feed) > 2  # a row's first proposal prefills its whole prompt: once per row
        if catch_up:
            t0 = time.perf_counter()
        live = [i for i, j in enumerate(rows) if limits[j] > 1]
        while live:
            step = self.backend.decode(self.cache, [slots[i] for i in live],
                                       np.array([tokens[i][-1] for i in live], np.int64), want_logits=False)
            for i, t in zip(live, step.next_token):
                tokens[i].append(int(t))
            live = [i for i in live if len(tokens[i]) < limits[rows[i]]]
        for i, j in enumerate(rows):
            drafts[j] = np.array(tokens[i], np.int64)
        made = sum(len(t) for t in tokens) - (len(rows) if catch_up else 0)  # tokens the timed part drafted
        if made > 0:  # the cost of one drafted token, without a catch-up prefill (the planner's price)
            per_token = (time.perf_counter() - t0) / made
            self.seconds_per_token = per_token if not self.seconds_per_token else 0.8 * self.seconds_per_token + 0.2 * per_token
        return drafts, [1] * len(seqs)

    def release(self, seq: Any) -> None:
        slot = self.slot_of.pop(seq, None)
        if slot is not None:
            self.cache.reset(slot)
