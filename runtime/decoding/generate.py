"""The decode loop's verbs: a sequence's state, choosing tokens, prefill and one decode step.

The loop itself (which slots run when) is the engine, runtime/engine/. Nothing here
imports onnxruntime or tensorrt: a backend is anything that follows runtime/backends/backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Sequence as Seq

import numpy as np

from decodert.runtime.backends.backend import Backend, KVCache, StepOutput
from decodert.runtime.backends.kv_cache import common_prefix
from decodert.runtime.constraints import Guide
from decodert.runtime.mask_overlap import masks_ahead
from decodert.runtime.decoding.metrics import Metrics, Timer
from decodert.runtime.decoding.sampling import (SamplingParams, apply_processors, draw, greedy, log_normalise, log_softmax,
                                                make_distribution, make_logits_processors, make_sampler)
from decodert.runtime.decoding.text import Decoder, IncrementalDetokenizer, StopMatcher
from decodert.runtime.vision.tokens import text_ids


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the distribution it was drawn from (``logprobs=True``):
    the logits after the grammar's mask, penalties and logit_bias, then (when sampling) temperature,
    top-k, min-p and top-p, renormalised; greedy: their log_softmax. Under SmolLM2's default top_p 0.5 a
    confident step keeps one token: logprob 0.0, one alternative (pass top_p=1.0 for the fuller picture).
    A token the token budget forced to close a structured output (runtime/closing.py) was not drawn:
    logprob 0.0, itself the only alternative. docs/SERVING.md "logprobs" says the same for the server."""

    token_id: int
    logprob: float  # <= 0; the distribution it was drawn from: Sequence._choose_logged
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the top_logprobs most likely, descending

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(p) for p in self.top]}


@dataclass(frozen=True)
class TranscriptSegment:
    """One timestamped piece of a transcription (Whisper's ``transcribe(..., timestamps=True)``): seconds from the
    clip's start, its text, its ids (timestamp tokens included), the mel frame (100 a second) its 30 s window
    started at, and that window's mean token log-probability, compression ratio and temperature."""

    start: float
    end: float
    text: str
    token_ids: list[int]
    seek: int
    avg_logprob: float
    compression_ratio: float
    temperature: float = 0.0

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "text": self.text, "token_ids": self.token_ids, "seek": self.seek,
                "avg_logprob": self.avg_logprob, "compression_ratio": self.compression_ratio,
                "temperature": self.temperature}


@dataclass
class GenerationResult:
    """One finished request."""

    text: str  # generated text, stop string excluded
    token_ids: list[int]  # generated ids, including a final stop/eos token
    finish_reason: str  # "stop" | "length" | "tool_calls" (chat with tools)
    metrics: Metrics
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, with logprobs=True
    reasoning: str | None = None  # chat: the model's reasoning (<think>...</think>), apart from text
    tool_calls: list[dict] | None = None  # chat with tools: OpenAI [{id, type, function: {name, arguments}}]
    stop_sequence: str | None = None  # the stop string that ended it (None: eos, a stop token id, or length)
    segments: list[TranscriptSegment] | None = None  # a timestamped transcription's segments, in order

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "metrics": self.metrics.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.stop_sequence is not None:
            out["stop_sequence"] = self.stop_sequence
        if self.segments is not None:
            out["segments"] = [s.to_dict() for s in self.segments]
        return out


class Sequence:
    """One request in flight: prompt, sampler state, text state; ``result()`` once ``done``.

    Capacity: prompt + generated tokens never exceed ``max_seq`` (the last token need not be
    cached, every earlier one is); reaching it ends the request with "length".
    """

    def __init__(self, prompt: np.ndarray, params: SamplingParams, tokenizer: Decoder,
                 eos_token_ids: Iterable[int], max_seq: int, guide: Guide | None = None) -> None:
        self.prompt = np.asarray(prompt, dtype=np.int64)  # [L]
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.sampler = make_sampler(params.temperature, params.top_k, params.top_p, params.min_p, self.rng)
        self.processors = make_logits_processors(params.repetition_penalty, params.presence_penalty,
                                                 params.frequency_penalty, params.logit_bias)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs else None  # one per chosen token
        self.stop_ids = frozenset(params.stop_token_ids) | frozenset(int(t) for t in eos_token_ids)
        self.max_seq = max_seq
        self.history = np.zeros(max_seq, dtype=np.int64)  # [max_seq] prompt then generated ids
        self.history[: len(self.prompt)] = text_ids(self.prompt)  # image ids read as <image> (runtime/vision/tokens.py)
        self.length = len(self.prompt)
        self.detok = IncrementalDetokenizer(tokenizer, self.history[: self.length].tolist())
        self.stopper = StopMatcher(params.stop)
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens whose K/V was reused, not prefilled (set by prefill)
        self.placement = ""  # which backend ran each phase (runtime/backends/placement.py; set by the engine)
        self.timer = Timer()
        self.guide = guide  # structured output (runtime/constraints.py): masks the logits, ends at the grammar's end
        self.images: Any = None  # the image store entries its prompt's image ids need (runtime/vision/encoder.py)
        self.spec = None  # speculative decoding state (runtime/speculation/speculative.py), when asked for
        self.adapter = (0, 0)  # LoRA (slot index, load tag) the row runs under (runtime/adapters.py); (0, 0): none
        self.watch: Callable[[str], bool] | None = None  # fed each shown text; True ends the row ("stop"): a chat
        # turn's repeated tool call (runtime/chat/turn.py ChatTurn.watcher)

    @property
    def needs_logits(self) -> bool:
        """Whether choosing this row's token needs the logits (not just the graph's argmax)."""
        return not self.params.greedy or bool(self.processors) or self.guide is not None or self.params.logprobs

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> np.ndarray:
        return self.history[len(self.prompt): self.length]  # [n_generated]

    @property
    def last_token(self) -> int:
        return int(self.history[self.length - 1])

    def choose(self, logits: np.ndarray, argmax: int | None = None) -> int:
        """Sample this row's next token from its logits [V] (``argmax``: the graph's, if known)."""
        if self.guide is not None:
            if argmax is not None and self.params.greedy and not self.processors and self.logprobs is None \
                    and self.guide.allows(argmax):
                return self.fit(argmax)  # the unconstrained choice is allowed: no [V] work
            logits = self.guide.mask_logits(logits)  # before penalties and sampling transforms
        row = apply_processors(self.processors, self.history[: self.length], logits[None, :])  # [1, V]
        if self.logprobs is None:
            return self.fit(int(self.sampler(row)[0]))
        return self._choose_logged(row[0])

    def _choose_logged(self, row: np.ndarray) -> int:
        """``choose`` that records the token's log-probability (and the top ones) from the same
        distribution it draws from, with the same random draws as without logprobs (a guided row's
        closing token, when its budget forces one, was not drawn: it is recorded as certain, logprob 0)."""
        p = self.params
        if p.greedy:
            logp = log_softmax(row)  # [V] float64
            token = int(greedy(row[None, :])[0])
        else:
            probs = make_distribution(p.temperature, p.top_k, p.top_p, p.min_p)(row[None, :])  # [1, V]
            token = int(draw(probs, self.rng)[0])  # what self.sampler would draw
            logp = log_normalise(probs[0])
        token = self.fit(token)
        if self.guide is not None and self.guide.forced:  # a closing token, not a draw: certain
            self.logprobs.append(TokenLogprob(token, 0.0, ((token, 0.0),) if p.top_logprobs else ()))  # type: ignore[union-attr]
            return token
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs:
            k = min(p.top_logprobs, logp.size)
            best = np.argpartition(-logp, k - 1)[:k]  # [k]
            best = best[np.lexsort((best, -logp[best]))]  # descending, ties by id
            top = tuple((int(t), float(logp[t])) for t in best if np.isfinite(logp[t]))
        self.logprobs.append(TokenLogprob(token, float(logp[token]), top))  # type: ignore[union-attr]
        return token

    def fit(self, token: int) -> int:
        """A guided row's token, replaced by a closing one when the output must close to fit its budget."""
        if self.guide is None:
            return token
        budget = min(self.params.max_new_tokens - len(self.generated), self.max_seq - self.length)
        return self.guide.fit(token, budget)

    def accept(self, token: int) -> str:
        """Record a generated token; return the text it makes safe to show, and maybe finish."""
        self.history[self.length] = token
        self.length += 1
        self.timer.token()
        if self.guide is not None:
            self.guide.advance(token)
        if token in self.stop_ids:
            return self._finish("stop", self._safe(self.detok.flush()))
        text = self._safe(self.detok.push(token))
        if self.stopper.stopped or (self.watch is not None and self.watch(text)):
            return self._finish("stop", text)
        if self.guide is not None and self.guide.finished:  # complete: only eos could follow
            return self._finish("stop", text + self._safe(self.detok.flush()))
        if len(self.generated) >= self.params.max_new_tokens or self.length >= self.max_seq:
            return self._finish("length", text + self._safe(self.detok.flush()))
        self.parts.append(text)
        return text

    def _safe(self, raw: str) -> str:
        """The part of ``raw`` that cannot be (the start of) a stop string."""
        return self.stopper.push(raw)[0]

    def _finish(self, reason: str, text: str) -> str:
        if not self.stopper.stopped:
            text += self.stopper.flush()
        self.finish_reason = "stop" if self.stopper.stopped else reason
        if self.guide is not None and self.guide.cut and self.finish_reason == "stop":
            self.finish_reason = "length"  # closed early to fit the budget
        self.parts.append(text)
        return text

    def result(self) -> GenerationResult:
        assert self.done, "result() before the sequence finished"
        metrics = self.timer.metrics(len(self.prompt), self.cached_tokens, self.placement)
        if self.spec is not None:
            metrics = self.spec.annotate(metrics)
        return GenerationResult("".join(self.parts), self.generated.tolist(), self.finish_reason, metrics,
                                None if self.logprobs is None else list(self.logprobs),
                                stop_sequence=self.stopper.matched if self.finish_reason == "stop" else None)


class TextStream:
    """Iterator of text deltas (str). ``text`` is what was streamed so far; ``result`` is set at the end."""

    def __init__(self, events: Generator[tuple[int, str], None, None], seq: Sequence) -> None:
        self._events = events
        self._seq = seq
        self.result: GenerationResult | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        for _, delta in self._events:
            if delta:
                return delta
        if self.result is None and self._seq.done:
            self.result = self._seq.result()
        raise StopIteration

    @property
    def text(self) -> str:
        return "".join(self._seq.parts)

    def close(self) -> None:
        self._events.close()


def choose_tokens(seqs: Seq[Sequence], step: StepOutput) -> np.ndarray:
    """Next token per row [n] int64: the graph's argmax, or the row's processors + sampler. An argmax whose
    score is NaN or infinite (where the backend gives that row's logits) is ``greedy``'s choice instead: NaN
    never chosen, and a row with no finite score the error sampling gives."""
    tokens = np.asarray(step.next_token, dtype=np.int64).reshape(-1).copy()  # [n]
    for j, seq in enumerate(seqs):
        if seq.needs_logits:
            tokens[j] = seq.choose(step.logits[j], int(tokens[j]))
        elif step.logits is not None and not np.isfinite(step.logits[j, tokens[j]]):
            tokens[j] = int(greedy(step.logits[j][None, :])[0])
    return tokens


def prefill(backend: Backend, cache: KVCache, slots: Seq[int], seqs: Seq[Sequence], prefix: Any = None) -> list[str]:
    """Run all prompts in one call, accept each row's first token -> text deltas.

    Each slot continues after the longest beginning of its prompt that the row holds (nothing for a
    new row; a session's row keeps its conversation): the row is rewound to that first, and at least
    the prompt's last token is run (its logits choose the first new token). ``prefix``
    (runtime/prefix_cache.py) then loads the longest cached prefix, and keeps the prompt's whole
    blocks after the call; ``seq.cached_tokens`` counts the tokens not prefilled. A hybrid row (with
    states) first runs up to each boundary where the prefix cache keeps states (``_run_to_stops``).
    """
    for slot, seq in zip(slots, seqs):
        seq.timer.start()
        cache.use_adapter(slot, *seq.adapter)  # a row holding another adapter's K/V starts empty
        same = common_prefix(cache.held(slot), seq.prompt, len(seq.prompt) - 1)
        cache.rewind(slot, cache.rewind_point(slot, same))  # a row with states: its length, its snapshot or 0
        if prefix is not None:
            prefix.load(cache, slot, seq.prompt)
        seq.cached_tokens = int(cache.lengths[slot])
    if prefix is not None and cache.has_state:
        _run_to_stops(backend, cache, slots, seqs, prefix)
    want = any(s.needs_logits for s in seqs)
    with masks_ahead(seqs):
        step = backend.prefill(cache, list(slots), [s.prompt[int(cache.lengths[slot]):] for slot, s in zip(slots, seqs)],
                               want_logits=want)
    for slot in slots:  # a hybrid row can come back to its prompt's end (a session's next turn); no-op for K/V
        cache.snapshot(slot)
    if prefix is not None:
        for slot, seq in zip(slots, seqs):
            prefix.store(cache, slot)
    return [s.accept(int(t)) for s, t in zip(seqs, choose_tokens(seqs, step))]


def _run_to_stops(backend: Backend, cache: KVCache, slots: Seq[int], seqs: Seq[Sequence], prefix: Any) -> None:
    """Rows with states (a hybrid model) keep them only where a call ends: run each prompt up to the
    block boundaries where the prefix cache keeps states (``prefix.stops``), storing at each; the rows
    that still have a stop share each call."""
    stops = {slot: list(prefix.stops(cache, slot, seq.prompt)) for slot, seq in zip(slots, seqs)}
    while True:
        rows = [(slot, seq) for slot, seq in zip(slots, seqs) if stops[slot]]
        if not rows:
            return
        ends = [stops[slot].pop(0) for slot, _ in rows]
        backend.prefill(cache, [slot for slot, _ in rows],
                        [seq.prompt[int(cache.lengths[slot]) : end] for (slot, seq), end in zip(rows, ends)], want_logits=False)
        for slot, _ in rows:
            prefix.store(cache, slot)


def decode_step(backend: Backend, cache: KVCache, slots: Seq[int], seqs: Seq[Sequence]) -> list[str]:
    """Feed each row's last token, accept the next one -> text deltas."""
    ids = np.array([s.last_token for s in seqs], dtype=np.int64)  # [n]
    want = any(s.needs_logits for s in seqs)
    with masks_ahead(seqs):
        step = backend.decode(cache, list(slots), ids, want_logits=want)
    return [s.accept(int(t)) for s, t in zip(seqs, choose_tokens(seqs, step))]
