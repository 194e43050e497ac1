"""Drafting with a head that reads the target's hidden states (``speculative="assistant"``: Gemma 4's assistant).

``HeadDrafter.propose`` chains k greedy draft tokens per row from the head's graph (export/heads/): step 1 takes
the target's scaled embedding of the row's pending token (rows of the target's own weights.bin, not a copy) and the
target's hidden state at the position before it (the backend keeps them: runtime/backends/hidden_rows.py); each
further step takes its own token and the head's ``hidden_out``, at the same position over the same target K/V
(the target cache's rows, bound read-only from the KVCache that owns them: the head keeps no cache, so nothing
is rewound for it). The target verifies the drafts as it verifies a draft model's: greedy drafts are a one-hot
proposal, so the acceptance rule (runtime/speculation/speculative.py ``_choose``) and its exactness are the same.
k comes from the planner's measured costs, ``seconds_per_token`` the head's measured step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence as Seq

import numpy as np

from decodert.artifact.heads import HEAD_METHODS, target_embedding
from decodert.errors import DecodertError
from decodert.runtime.backends.kv_cache import contiguous_runs
from decodert.runtime.decoding.sampling import top_probability
from decodert.runtime.speculation.drafters import end_chains


def head_drafter(backend: Any, folder: str | Path, record: dict) -> Any:
    """The drafter of the head artifact ``folder`` (its record ``record``): by the family head.json names."""
    if record["family"] in ("qwen3_5_mtp", "eagle3"):  # a K/V of its own
        from decodert.runtime.speculation.mtp import Eagle3Drafter, MtpDrafter

        drafter = (Eagle3Drafter if record["family"] == "eagle3" else MtpDrafter)(backend, folder, record)
    else:
        drafter = HeadDrafter(backend, folder, record)
    drafter.method = HEAD_METHODS[record["family"]]
    return drafter


class HeadDrafter:
    """Greedy chained drafts from a head artifact beside the target (export/heads/__init__.py ``load_head``)."""

    method = "assistant"

    def __init__(self, backend: Any, folder: str | Path, record: dict) -> None:
        if getattr(backend, "name", None) != "ort":
            raise DecodertError("draft heads run on the ort backend for now (--backend ort)")
        self.backend, self.record = backend, record
        self.rows = backend.keep_hidden()  # the target's hidden states per slot from now on
        folder = Path(folder)
        self.session = backend.open_graph(str((folder / record["graph"]["file"]).resolve()))  # the target's options
        spec = backend.manifest.model.spec()
        self.dtype = backend.np_dtype
        self.embed = target_embedding(backend.dir, backend.manifest)
        self.scale = self.dtype(spec.embed_scale) if spec.embed_scale is not None else None
        self.reads = sorted(set(int(i) for i in record["reads"]["kv_layers"].values()))
        self.seconds_per_token = 0.0  # EMA, measured
        self.confidences: list[np.ndarray] = []  # the last proposal's: the head's probability of each draft, per row
        self._bindings: dict[tuple[int, ...], tuple[Any, dict[str, np.ndarray]]] = {}

    def _embeds(self, tokens: np.ndarray) -> np.ndarray:
        rows = np.asarray(self.embed[tokens], self.dtype)
        return rows * self.scale if self.scale is not None else rows

    def propose(self, seqs: Seq[Any], limits: Seq[int],
                keep: Callable[[np.ndarray], bool] | None = None) -> tuple[list[np.ndarray], list[int]]:
        """Chained drafts (up to ``limits[j]``) and, in ``confidences``, the head's probability of each.
        ``keep(probs)``: False where the last of a row's drafts with these probabilities is not worth
        verifying (its chain ends before it; the head stops once every row of a run has ended)."""
        drafts = [np.zeros(0, np.int64) for _ in seqs]
        self.confidences = [np.zeros(0) for _ in seqs]
        t0, made = time.perf_counter(), 0
        rows = []  # (j, slot, L, hidden)
        for j, (seq, k) in enumerate(zip(seqs, limits)):
            at = getattr(seq.spec, "at", None)  # (cache, slot): set by speculative.step
            if k <= 0 or at is None:
                continue
            cache, slot = at
            length = int(cache.lengths[slot])
            hidden = self.rows.at(slot, length - 1) if length == seq.length - 1 else None
            if hidden is not None:
                rows.append((j, slot, length, hidden))
        if not rows:
            return drafts, [1] * len(seqs)
        cache = seqs[rows[0][0]].spec.at[0]
        slots = [r[1] for r in rows]
        for run in contiguous_runs(slots):
            group = [rows[i] for i in run]
            k = max(limits[j] for j, *_ in group)
            io, buf = self._binding(cache, group[0][1], len(group))
            buf["hidden"][:] = np.stack([h for *_, h in group])
            buf["past_lengths"][:] = [length for _, _, length, _ in group]
            last = np.array([seqs[j].last_token for j, *_ in group], np.int64)
            tokens, probs = np.zeros((len(group), k), np.int64), np.zeros((len(group), k))
            ends = np.array([limits[j] for j, *_ in group])  # drafts each row keeps
            for step in range(k):
                buf["token_embeds"][:] = self._embeds(last)
                self.session.run_with_iobinding(io)
                last = tokens[:, step] = buf["next_token"]
                probs[:, step] = top_probability(buf["logits"])
                buf["hidden"][:] = buf["hidden_out"]  # the next step's h
                made += len(group)
                if not end_chains(ends, probs, step, keep):
                    break
            for r, (j, *_) in enumerate(group):
                drafts[j] = tokens[r, : ends[r]].copy()
                self.confidences[j] = probs[r, : ends[r]].copy()
        per_token = (time.perf_counter() - t0) / max(made, 1)
        self.seconds_per_token = per_token if not self.seconds_per_token else 0.8 * self.seconds_per_token + 0.2 * per_token
        return drafts, [1] * len(seqs)

    def _binding(self, cache: Any, start: int, n: int) -> tuple[Any, dict[str, np.ndarray]]:
        """An IOBinding for rows [start, start+n): the target cache's rows of the layers the head reads bound in
        place, and fixed buffers for the step's inputs and outputs (kept per cache and rows)."""
        read = [(2 * i + kv, f"past_{name}.{layer}") for i, layer in enumerate(cache.kv_layers) if layer in self.reads
                for kv, name in enumerate(("key", "value"))]
        key = (n, *(cache.pointer(b, start) for b, _ in read))  # the addresses themselves: a new cache binds anew
        got = self._bindings.get(key)
        if got is not None:
            return got
        io = self.session.io_binding()
        for b, name in read:
            io.bind_input(name, cache.device, 0, cache.dtype, (n, *cache.slot_shapes[b]), cache.pointer(b, start))
        width, vocab = self.embed.shape[1], self.embed.shape[0]
        buf = {"token_embeds": np.zeros((n, width), self.dtype), "hidden": np.zeros((n, width), self.dtype),
               "past_lengths": np.zeros(n, np.int64), "logits": np.empty((n, vocab), np.float32),
               "next_token": np.empty(n, np.int64), "hidden_out": np.empty((n, width), self.dtype)}
        for name, arr in buf.items():
            bind = io.bind_input if name in ("token_embeds", "hidden", "past_lengths") else io.bind_output
            bind(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        self._bindings[key] = (io, buf)
        return io, buf

    def release(self, seq: Any) -> None:
        pass
