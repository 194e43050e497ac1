"""A deterministic numpy backend (runtime/backends/backend.py protocol) for testing the loop in isolation.

The "model": the logits after a token sequence ``h`` (length T) are

    W[h[-1]] + P[T-1] + H[sum_t h[t] * (t+1) mod V]        # [V]

so they depend on the last token, its position and the whole history: a slot mixed up, a
cache length off by one or a row decoded twice changes the output. The cache stores the token
ids themselves (its "K/V"), so ``reference_tokens`` can recompute everything from scratch.

``states=True`` makes it a hybrid: each row also keeps a recurrent state ``mix.0`` = (tokens seen,
``sum_t h[t] * (t+1)`` mod ``MIX_MOD``), updated by every call over the ids it runs (``mix_state``), as a
linear layer's state summarises a row; every call asserts that the row's state is the one of the
ids its K/V holds (the model reads its state, so a wrong one would be a wrong answer).

Each row's write is one graph run: the state and the "K/V" are written in place, then the ids committed,
inside ``KVCache.writing`` as a real backend does. ``interrupt_in = k`` raises KeyboardInterrupt in the
k-th run from now, after its in-place writes and before its commit (where Ctrl-C lands mid-prefill).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decodert.artifact.manifest import (FORMAT, FORMAT_VERSION, KVRecord, Manifest, ModelRecord, SamplingRecord, TokenizerRecord,
                                      WeightsRecord)
from decodert.runtime.backends.backend import StepOutput, VerifyOutput
from decodert.runtime.backends.kv_cache import KVCache
from decodert.runtime.llm import LLM

CORPUS = [
    "hello world, this is a tiny test corpus for decodert.",
    "the quick brown fox jumps over the lazy dog. STOP here.",
    "héllo wörld: accents and other things, said the user to the assistant.",
]
SPECIALS = ["<|eos|>", "<|user|>", "<|assistant|>"]


class FakeCache(KVCache):
    """The runtime's KVCache with no K/V buffers; its "K/V" is the token ids: tokens [slots, max_seq]
    int64 (-1 = empty), lengths [slots]."""

    def __init__(self, slots: int, max_seq: int, states: bool = False) -> None:
        super().__init__(slots, max_seq, layers=0, kv_heads=1, head_dim=1, dtype=np.int64,
                         states=[("mix.0", (2,), np.int64)] if states else ())
        self.tokens = np.full((slots, max_seq), -1, dtype=np.int64)  # [slots, max_seq] the "K/V"; stale past lengths, as real K/V


MIX_MOD = 1_000_003


def mix_state(ids: np.ndarray) -> np.ndarray:
    """The hybrid fake's state after ``ids``: [len, sum_t ids[t] * (t+1) mod MIX_MOD] int64."""
    ids = np.asarray(ids, np.int64)
    return np.array([len(ids), int((ids * np.arange(1, len(ids) + 1)).sum()) % MIX_MOD], np.int64)


class FakeBackend:
    """``rule(history [T]) -> token`` replaces the random model when given (scripted outputs)."""

    name = "fake"

    def __init__(self, vocab_size: int = 97, max_seq: int = 64, max_batch: int = 4, seed: int = 0,
                 rule: Callable[[np.ndarray], int] | None = None, states: bool = False) -> None:
        self.states = states
        self.vocab_size, self.max_seq, self.max_batch = vocab_size, max_seq, max_batch
        rng = np.random.default_rng(seed)
        self.W = rng.standard_normal((vocab_size, vocab_size)).astype(np.float32) * 3  # [V, V]
        self.P = rng.standard_normal((max_seq, vocab_size)).astype(np.float32)  # [max_seq, V]
        self.H = rng.standard_normal((vocab_size, vocab_size)).astype(np.float32)  # [V, V]
        self.rule = rule
        self.calls: list[tuple[str, tuple[int, ...], bool]] = []  # (kind, slots, want_logits)
        self.interrupt_in: int | None = None  # runs until one is interrupted before its commit (None: never)

    # -- the model ------------------------------------------------------------------------
    def logits_for(self, history: np.ndarray) -> np.ndarray:
        """Next-token logits [V] float32 after ``history`` [T] (T >= 1)."""
        if self.rule is not None:
            out = np.full(self.vocab_size, -10.0, dtype=np.float32)
            out[self.rule(history)] = 10.0
            return out
        t = len(history)
        mix = int((history * np.arange(1, t + 1)).sum()) % self.vocab_size
        return self.W[history[-1]] + self.P[t - 1] + self.H[mix]

    # -- the protocol ---------------------------------------------------------------------
    def allocate(self, slots: int) -> FakeCache:
        assert 1 <= slots <= self.max_batch, f"allocate({slots}) with max_batch {self.max_batch}"
        return FakeCache(slots, self.max_seq, self.states)

    def prefill(self, cache: FakeCache, slots: Sequence[int], ids: Sequence[np.ndarray],
                want_logits: bool) -> StepOutput:
        self.calls.append(("prefill", tuple(slots), want_logits))
        assert len(slots) == len(ids) and len(set(slots)) == len(slots)
        for slot, row in zip(slots, ids):
            self._write(cache, slot, np.asarray(row, dtype=np.int64))
        return self._output(cache, slots, want_logits)

    def decode(self, cache: FakeCache, slots: Sequence[int], ids: np.ndarray, want_logits: bool) -> StepOutput:
        self.calls.append(("decode", tuple(slots), want_logits))
        assert ids.shape == (len(slots),) and len(set(slots)) == len(slots)
        for slot, tok in zip(slots, ids):
            self._write(cache, slot, np.array([tok], dtype=np.int64))
        return self._output(cache, slots, want_logits)

    verify_width = 16

    def prepare_verify(self, rows: int) -> None:
        pass  # nothing to open

    def verify(self, cache: FakeCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> VerifyOutput:
        self.calls.append(("verify", tuple(slots), want_logits))
        assert len(slots) == len(ids) and len(set(slots)) == len(slots)
        width = max(len(r) for r in ids)
        assert 1 <= min(len(r) for r in ids) and width <= self.verify_width
        logits = np.zeros((len(slots), width, self.vocab_size), np.float32)  # [n, W, V]
        for j, (slot, row) in enumerate(zip(slots, ids)):
            start = int(cache.lengths[slot])
            self._write(cache, slot, np.asarray(row, dtype=np.int64))
            for i in range(len(row)):
                logits[j, i] = self.logits_for(cache.tokens[slot, : start + i + 1])
        return VerifyOutput(logits.argmax(-1).astype(np.int64), logits if want_logits else None)

    def move_slot(self, cache: FakeCache, src: int, dst: int) -> None:
        self.calls.append(("move", (src, dst), False))
        cache.tokens[dst] = cache.tokens[src]
        for buf in cache.states:
            buf[dst] = buf[src]
        cache.move(src, dst)

    # the K/V blocks of runtime/backends/kv_blocks.py: here a block is the token ids themselves
    def kv_bytes(self, n: int) -> int:
        return 8 * n

    def read_kv(self, cache: FakeCache, slot: int, start: int, n: int) -> np.ndarray:
        self.calls.append(("read_kv", (slot, start, n), False))
        assert start + n <= cache.lengths[slot], f"read_kv past slot {slot}'s {cache.lengths[slot]} tokens"
        return cache.tokens[slot, start:start + n].copy()  # [n]

    def write_kv(self, cache: FakeCache, slot: int, start: int, block: np.ndarray) -> None:
        self.calls.append(("write_kv", (slot, start, len(block)), False))
        cache.tokens[slot, start:start + len(block)] = block

    def free_kv(self, block: np.ndarray) -> None:
        pass

    def _write(self, cache: FakeCache, slot: int, row: np.ndarray) -> None:
        start = int(cache.lengths[slot])
        assert row.ndim == 1 and row.size >= 1, "empty row"
        assert start + row.size <= cache.max_seq, f"slot {slot}: {start}+{row.size} tokens > max_seq {cache.max_seq}"
        with cache.writing([slot]):
            if cache.states:  # the graph reads the row's state and writes it forward over the new ids, in place
                n, mix = (int(x) for x in cache.states[0][slot])
                assert n == start and mix == mix_state(cache.tokens[slot, :start])[1], \
                    f"slot {slot}: state {[n, mix]} is not the one of the {start} ids its K/V holds"
                cache.states[0][slot] = [start + row.size,
                                         (mix + int((row * np.arange(start + 1, start + row.size + 1)).sum())) % MIX_MOD]
            cache.tokens[slot, start:start + row.size] = row
            if self.interrupt_in is not None:
                self.interrupt_in -= 1
                if self.interrupt_in == 0:
                    self.interrupt_in = None
                    raise KeyboardInterrupt
            cache.commit([slot], [row])

    def _output(self, cache: FakeCache, slots: Sequence[int], want_logits: bool) -> StepOutput:
        logits = np.stack([self.logits_for(cache.tokens[s, :cache.lengths[s]]) for s in slots])  # [n, V]
        return StepOutput(next_token=logits.argmax(-1).astype(np.int64), logits=logits if want_logits else None)

    # -- test helpers ---------------------------------------------------------------------
    def rows_decoded(self) -> int:
        return sum(len(slots) for kind, slots, _ in self.calls if kind == "decode")


def reference_tokens(backend: FakeBackend, prompt: Sequence[int], n: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Greedy continuation computed from scratch (no cache), stopping after a stop id."""
    history = list(prompt)
    out: list[int] = []
    while len(out) < n and len(history) < backend.max_seq:
        tok = int(backend.logits_for(np.array(history, dtype=np.int64)).argmax())
        out.append(tok)
        history.append(tok)
        if tok in stop_ids:
            break
    return out


def make_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE trained on CORPUS: ids 0..2 are SPECIALS; unseen characters stay byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_llm(tokenizer: Tokenizer | None = None, eos: Sequence[int] = (), chat_template: str | None = None,
             add_bos_token: bool = False, prefix_cache_mb: float | None = None, **backend_kwargs) -> LLM:
    """An LLM over a FakeBackend whose vocabulary is the tokenizer's."""
    tok = tokenizer or make_tokenizer()
    backend = FakeBackend(vocab_size=tok.get_vocab_size(), **backend_kwargs)
    return LLM(backend, tok, fake_manifest(backend, eos, add_bos_token, chat_template), prefix_cache_mb=prefix_cache_mb)


def fake_manifest(backend: FakeBackend, eos: Sequence[int] = (), add_bos_token: bool = False,
                  chat_template: str | None = None, sampling: dict | None = None) -> Manifest:
    """A Manifest for an LLM over ``backend`` (no files: nothing is loaded from disk)."""
    return Manifest(
        format=FORMAT, format_version=FORMAT_VERSION, model=ModelRecord(vocab_size=backend.vocab_size), target="ort",
        dtype="fp32", max_seq=backend.max_seq, max_batch=backend.max_batch,
        kv=KVRecord(num_layers=1, num_kv_heads=1, head_dim=1), graphs={}, weights=WeightsRecord(file="weights.bin"),
        tokenizer=TokenizerRecord(eos_token_ids=tuple(eos), bos_token_id=1, add_bos_token=add_bos_token,
                                  chat_template=chat_template),
        files={}, sampling=None if sampling is None else SamplingRecord(defaults=sampling, source="test"))


def scripted_llm(text: str, eos: Sequence[int] = (0,), **kw) -> tuple[LLM, list[int]]:
    """An LLM whose model writes ``text`` token by token after any prompt, then eos (id 0).

    Prompts must start with distinct token ids (the rule finds a prompt's length by its first id).
    """
    tok = make_tokenizer()
    script = tok.encode(text).ids + [0]
    prompt_len: dict[int, int] = {}

    def rule(history: np.ndarray) -> int:
        start = prompt_len.setdefault(int(history[0]), len(history))
        return script[min(len(history) - start, len(script) - 1)]

    return make_llm(tok, eos=eos, rule=rule, **kw), script
