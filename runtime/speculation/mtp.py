"""Drafting with a head that has attention of its own, so a small K/V of its own: Qwen3.5's MTP layer
(``speculative="mtp"``) and EAGLE-3 heads (``speculative="eagle3"``, ``Eagle3Drafter`` below: the same machinery).

The head's entry at position p is the MTP layer run on the pair (h_p: the target's hidden state at p, the token at
p + 1) at RoPE position p (export/heads/qwen3_5_mtp.py). ``MtpDrafter.propose`` for a row whose target cache holds L
positions, the pending token t_L not run yet:

    step 1      catch up: the pairs of positions M..L-1 (M: the entries the head holds for the row), from the target's
                hidden rows of the last pass (runtime/backends/hidden_rows.py) -> their entries, and the draft d1 from
                the last one (the pair (h_{L-1}, t_L))
    step i > 1  the pair (the head's own hidden_out, d_{i-1}) at position L + i - 2 -> d_i; its entry is scratch

``HeadCache`` owns the head's K/V, one row per target cache slot, written by the drafter through one rule:

    an entry at position p is kept while the row's history still begins with the tokens 0..p+1 it was computed
    from, p lies in the run of entries computed from the target's own hidden states, and p < the target's length.

So the head is rewound with the target's rows by the same tokens: a rejected draft, a new row in the slot, a
prefix hit or a session turn that rewound the target leave the head holding the longest beginning of the history
its entries still describe; the drafted steps' entries (their hidden state is the head's, not the target's) are
never kept: the next catch-up runs over them from the target's hidden rows. The target keeps the hidden rows of
its last pass only (a prefill's: every prompt position, ``prompt_hidden``), so the head follows every pass
(``follow``, at each speculative step, drafted or not). Where they do not reach back to the head's entries (a
prefix hit's cached positions, a long prompt's earlier chunks) the row's run starts again at the first position
they cover (``starts``): the head attends over the positions it holds an entry for. Drafts depend on it; the
tokens committed never do (the target verifies every draft, as a draft model's: greedy drafts are a one-hot
proposal).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence as Seq

import numpy as np

from decodert.artifact.heads import head_embedding
from decodert.errors import DecodertError
from decodert.runtime.backends.kv_cache import common_prefix
from decodert.runtime.decoding.sampling import top_probability
from decodert.runtime.speculation.drafters import end_chains


class HeadCache:
    """The MTP head's K/V per target slot: keys / values [slots, H_kv, max_seq, D]; per slot ``starts`` / ``lengths``
    (the run of entries [start, length) it holds) and ``tokens`` (the history they were computed from, 0..length)."""

    def __init__(self, slots: int, kv_heads: int, max_seq: int, head_dim: int, dtype: Any) -> None:
        self.keys = np.zeros((slots, kv_heads, max_seq, head_dim), dtype)
        self.values = np.zeros_like(self.keys)
        self.starts = np.zeros(slots, np.int64)
        self.lengths = np.zeros(slots, np.int64)
        self.tokens = [np.zeros(0, np.int64) for _ in range(slots)]

    def kept(self, slot: int, history: np.ndarray, target_length: int) -> int:
        """Rewind ``slot`` to the entries the rule keeps for a row of ``history`` whose target holds
        ``target_length`` positions; returns the new length."""
        same = common_prefix(self.tokens[slot], history, len(history))  # entry p needs tokens 0..p+1
        n = min(int(self.lengths[slot]), same - 1, target_length)
        if n <= self.starts[slot]:
            self.starts[slot] = n = max(n, 0)
        self.lengths[slot] = n
        return n

    def restart(self, slot: int, at: int) -> None:
        """The row's run starts again at position ``at`` (the entries before it are not read any more)."""
        self.starts[slot] = self.lengths[slot] = at

    def write(self, slot: int, at: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Entries [H_kv, n, D] at positions at..at+n-1 (scratch until ``settle`` counts them)."""
        n = keys.shape[1]
        self.keys[slot, :, at : at + n] = keys
        self.values[slot, :, at : at + n] = values

    def settle(self, slot: int, length: int, history: np.ndarray) -> None:
        """Entries up to ``length`` are the target's pairs, computed from history[: length + 1]."""
        self.lengths[slot] = length
        self.tokens[slot] = np.array(history[: length + 1], np.int64)

    def past(self, slots: Seq[int], upto: int) -> tuple[np.ndarray, np.ndarray]:
        """[n, H_kv, P, D] of the rows' first P = max(1, upto) positions (the graph's past_key / past_value)."""
        p = max(1, upto)
        return self.keys[list(slots), :, :p], self.values[list(slots), :, :p]


class MtpDrafter:
    """Greedy chained drafts from a qwen3_5_mtp head artifact (export/heads/__init__.py ``load_head``)."""

    def __init__(self, backend: Any, folder: str | Path, record: dict) -> None:
        if getattr(backend, "name", None) != "ort":
            raise DecodertError("draft heads run on the ort backend for now (--backend ort)")
        self.backend, self.record = backend, record
        self.rows = backend.keep_hidden()
        self.session = backend.open_graph(str((Path(folder) / record["graph"]["file"]).resolve()))
        self.dtype = backend.np_dtype
        self.embed = head_embedding(folder, record, backend.dir, backend.manifest)  # [V, hidden], read-only
        self.cache: HeadCache | None = None  # made for the first target cache seen (its slots and max_seq)
        self.seconds_per_token = 0.0  # EMA, measured
        self.follow_seconds = 0.0  # spent catching up at steps that did not draft (measured, reported by nobody yet)
        # slot -> (the head's token after t_L, its probability, its hidden_out at L-1, the HeadCache tokens 0..L it
        # settled): the last catch-up's output, which a proposal in the same step reuses instead of running the pair
        # L-1 again
        self._last: dict[int, tuple[int, float, np.ndarray, np.ndarray]] = {}
        self.confidences: list[np.ndarray] = []  # the last proposal's: the head's probability of each draft, per row

    def _head_cache(self, target: Any) -> HeadCache:
        if self.cache is None or len(self.cache.lengths) != target.slots or self.cache.keys.shape[2] != target.max_seq:
            c = self.record["cache"]
            self.cache = HeadCache(target.slots, c["num_kv_heads"], target.max_seq, c["head_dim"], self.dtype)
        return self.cache

    def _inputs(self, embeds: np.ndarray, hidden: np.ndarray, chained: bool) -> dict[str, np.ndarray]:
        """The head's own inputs for pairs (embeds, hidden) [B, S, .]: ``hidden`` is the target's rows (a
        catch-up) or the head's own hidden_out (``chained``); the MTP layer takes either as ``hidden``."""
        return {"token_embeds": embeds, "hidden": hidden}

    def _run(self, embeds: np.ndarray, hidden: np.ndarray, at: np.ndarray, starts: np.ndarray, n: np.ndarray,
             slots: list[int], chained: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One call: pairs [B, S] at positions at..at+n-1 over the head's entries -> (next_token, its
        probability, hidden_out, new keys, new values)."""
        keys, values = self.cache.past(slots, int(at.max()))
        logits, token, hidden_out, k, v = self.session.run(None, {
            **self._inputs(embeds, hidden, chained), "past_lengths": at, "past_starts": starts, "seq_lengths": n,
            "past_key.0": keys, "past_value.0": values})
        return token, top_probability(logits), hidden_out, k, v

    def follow(self, seqs: Seq[Any]) -> dict[int, tuple[int, float]]:
        """Catch the rows up with the target's last pass (runtime/speculation/speculative.step calls it at every
        step, drafted or not: the target's hidden rows are those of its last pass only). Returns, per row index
        caught up, its first draft (the head's token after the pending one: what a proposal now would start
        with) and the head's probability for it; a plain step judges the draft in hindsight, so the head's
        acceptance is known without verifying, and the planner prices the pass with the probability."""
        t0 = time.perf_counter()
        # last: a row whose entries a slot's earlier request left in place (the same tokens) still gets its draft
        rows, token, prob, _ = self._catch_up(seqs, range(len(seqs)), last=True)
        self.follow_seconds += time.perf_counter() - t0
        return {r[0]: (int(token[i]), float(prob[i])) for i, r in enumerate(rows)}

    def _followed(self, seqs: Seq[Any], wanted: Seq[int]) -> tuple[list, Any, Any, Any] | None:
        """``_catch_up(seqs, wanted, last=True)``'s result from this step's ``follow`` where every wanted row is
        still where that catch-up left it (the same target length, entries and tokens); else None."""
        rows, tokens, probs, hidden = [], [], [], []
        for j in wanted:
            at = getattr(seqs[j].spec, "at", None)
            if at is None or self.cache is None:
                return None
            target, slot = at
            length, last = int(target.lengths[slot]), self._last.get(slot)
            if (last is None or self.cache.tokens[slot] is not last[3] or len(last[3]) != length + 1
                    or length != seqs[j].length - 1
                    or self.cache.kept(slot, seqs[j].history[: seqs[j].length], length) != length):
                return None
            rows.append((j, slot, length, length, None))
            tokens.append(last[0])
            probs.append(last[1])
            hidden.append(last[2])
        return (rows, np.array(tokens, np.int64), np.array(probs), np.stack(hidden)) if rows else None

    def propose(self, seqs: Seq[Any], limits: Seq[int],
                keep: Callable[[np.ndarray], bool] | None = None) -> tuple[list[np.ndarray], list[int]]:
        """Chained drafts (up to ``limits[j]``) and, in ``confidences``, the head's probability of each.
        ``keep(probs)``: False where the last of a row's drafts with these probabilities is not worth
        verifying (its chain ends before it; the head stops calling once every row has ended)."""
        drafts = [np.zeros(0, np.int64) for _ in seqs]
        self.confidences = [np.zeros(0) for _ in seqs]
        t0 = time.perf_counter()
        wanted = [j for j, k in enumerate(limits) if k > 0]
        rows, token, prob, hidden_out = self._followed(seqs, wanted) or self._catch_up(seqs, wanted, last=True)
        if not rows:
            return drafts, [1] * len(seqs)
        cache, slots, b = self.cache, [r[1] for r in rows], len(rows)
        ends = np.array([limits[r[0]] for r in rows])  # drafts each row keeps
        steps = int(ends.max())
        tokens, probs = np.zeros((b, steps), np.int64), np.zeros((b, steps))
        tokens[:, 0], probs[:, 0] = token, prob
        position = np.array([r[2] for r in rows], np.int64)  # step 2's pair sits at L
        ones = np.ones(b, np.int64)
        chained = 0
        for step in range(steps):
            if not end_chains(ends, probs, step, keep):
                break
            embeds = np.asarray(self.embed[tokens[:, step]], self.dtype)[:, None]
            token, prob, hidden_out, k, v = self._run(embeds, hidden_out[:, None], position, cache.starts[slots], ones,
                                                      slots, chained=True)
            for i, slot in enumerate(slots):  # scratch: read by the next step, overwritten by the next catch-up
                cache.write(slot, int(position[i]), k[i], v[i])
            tokens[:, step + 1], probs[:, step + 1] = token, prob
            position = position + 1
            chained += 1
        for i, r in enumerate(rows):
            drafts[r[0]] = tokens[i, : ends[i]].copy()
            self.confidences[r[0]] = probs[i, : ends[i]].copy()
        if chained:  # the first draft came with the catch-up: a chained call is what one more token costs
            per_token = (time.perf_counter() - t0) / chained
            self.seconds_per_token = per_token if not self.seconds_per_token else 0.8 * self.seconds_per_token + 0.2 * per_token
        return drafts, [1] * len(seqs)

    def _catch_up(self, seqs: Seq[Any], wanted: Seq[int], last: bool = False) -> tuple[list, Any, Any, Any]:
        """Run the pairs of positions M..L-1 of the rows ``wanted`` (``last``: at least the pair at L-1, whose
        output drafts d1) -> (rows (j, slot, L, M, hidden rows), next_token, its probability, hidden_out at each
        row's L-1)."""
        rows = []
        for j in wanted:
            seq = seqs[j]
            at = getattr(seq.spec, "at", None)  # (cache, slot): set by speculative.step
            if at is None:
                continue
            target, slot = at
            length = int(target.lengths[slot])
            if length != seq.length - 1 or length < 1:
                continue
            cache = self._head_cache(target)
            history = seq.history[: seq.length]
            held = cache.kept(slot, history, length)
            if last:
                held = min(held, length - 1)  # the last pair runs again: it drafts d1
            got = self.rows.span(slot)  # (first position, [w, hidden]) of the target's last pass
            if held >= length or got is None or not got[0] <= length - 1 < got[0] + len(got[1]):
                continue
            first, computed = got
            if held < first:  # the target's rows do not reach back to the head's entries: a new run
                cache.restart(slot, first)
                held = first
            rows.append((j, slot, length, held, computed[held - first : length - first]))
        if not rows:
            return rows, None, None, None
        cache, slots = self.cache, [r[1] for r in rows]
        width, b, h, w = max(len(r[4]) for r in rows), len(rows), self.embed.shape[1], rows[0][4].shape[-1]
        embeds, hidden = np.zeros((b, width, h), self.dtype), np.zeros((b, width, w), self.dtype)  # w: the rows' width
        n = np.array([len(r[4]) for r in rows], np.int64)
        for i, (j, _, length, held, computed) in enumerate(rows):
            hidden[i, : n[i]] = computed
            embeds[i, : n[i]] = self.embed[seqs[j].history[held + 1 : length + 1]]  # the token after each position
        token, prob, hidden_out, k, v = self._run(embeds, hidden, np.array([r[3] for r in rows], np.int64),
                                                  cache.starts[slots], n, slots)
        for i, (j, slot, length, held, _) in enumerate(rows):
            cache.write(slot, held, k[i, :, : n[i]], v[i, :, : n[i]])
            cache.settle(slot, length, seqs[j].history)
            self._last[slot] = (int(token[i]), float(prob[i]), np.array(hidden_out[i]), cache.tokens[slot])
        return rows, token, prob, hidden_out

    def release(self, seq: Any) -> None:
        pass


class Eagle3Drafter(MtpDrafter):
    """Greedy chained drafts from an eagle3 head artifact (models/families/eagle3.py): the MTP layer's machinery
    and cache rule, with the target's rows being its three layers' inputs (fused by the head's fc in a catch-up)
    and a chained step feeding the head's pre-norm output instead. The head's graph takes both as inputs of
    their own (export/heads/eagle3.py): the one a call does not use is zeros."""

    def _inputs(self, embeds: np.ndarray, hidden: np.ndarray, chained: bool) -> dict[str, np.ndarray]:
        b, s = hidden.shape[:2]
        if chained:
            return {"token_embeds": embeds, "features": np.zeros((b, s, self.features), self.dtype), "hidden": hidden}
        return {"token_embeds": embeds, "features": hidden, "hidden": np.zeros((b, s, self.width), self.dtype)}

    @property
    def features(self) -> int:
        return 3 * int(self.record["spec"]["target_hidden_size"])

    @property
    def width(self) -> int:
        return int(self.record["spec"]["hidden_size"])
