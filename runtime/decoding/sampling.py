"""Sampling parameters, samplers and logits processors: plain callables over numpy arrays.

A sampler maps logits [n, V] float32 to token ids [n] int64. A logits processor maps
``(token_history [T] int64, logits [..., V] float32) -> logits``. Both are vectorised over
the vocabulary; nothing here loops over tokens in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from decodert.errors import DecodertError

GREEDY_EPS = 1e-5  # a temperature below this is greedy (argmax), as in vLLM: dividing by it would
#                   overflow the scores (1e-300: inf/NaN) and sampling that sharp is argmax anyway
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range: -100 bans a token, +100 forces it)
Sampler = Callable[[np.ndarray], np.ndarray]
LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (defaults: greedy, 256 new tokens)."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (HF semantics: divide positive, multiply negative)
    presence_penalty: float = 0.0  # subtracted once from every token already seen
    frequency_penalty: float = 0.0  # subtracted per occurrence of every token already seen
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = field(default=())
    logprobs: bool = False  # record each chosen token's log-probability (GenerationResult.logprobs)
    top_logprobs: int = 0  # and the most likely alternatives' (0..MAX_TOP_LOGPROBS; needs logprobs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added before sampling

    def __post_init__(self) -> None:
        # Accept lists (and a single stop string) from callers; store tuples. Other types are kept
        # as given for validate() to name (stop=5, stop_token_ids=["a"]); ids are not rounded.
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        bias = self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(bias.items()) if isinstance(bias, Mapping) else _as_tuple(bias))

    def validate(self) -> "SamplingParams":
        """Raise DecodertError with a one-line message for the first invalid setting."""
        for name, ok, rule in _RULES:
            value = getattr(self, name)
            if not ok(value):
                raise DecodertError(f"{name} must be {rule}, got {value!r:.80}")
        if self.top_logprobs and not self.logprobs:
            raise DecodertError("top_logprobs needs logprobs=True")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _as_tuple(value: object) -> object:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset, range)) else value


def _finite(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (  # (field, valid?, what valid means)
    ("max_new_tokens", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("temperature", lambda v: _finite(v) and v >= 0, f"a number >= 0 (below {GREEDY_EPS:g} = greedy)"),
    ("top_k", lambda v: _integer(v) and v >= 0, "an integer >= 0 (0 = off)"),
    ("top_p", lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    ("min_p", lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    ("repetition_penalty", lambda v: _finite(v) and v > 0, "a number > 0 (1 = off)"),
    ("presence_penalty", _finite, "a finite number"),
    ("frequency_penalty", _finite, "a finite number"),
    ("seed", lambda v: v is None or (_integer(v) and v >= 0), "None or an integer >= 0"),
    ("stop", lambda v: isinstance(v, tuple) and all(isinstance(s, str) and s for s in v),
     "a string or a list of non-empty strings"),
    ("stop_token_ids", lambda v: isinstance(v, tuple) and all(_integer(t) and 0 <= t < 2**63 for t in v),
     "a list of token ids (ints >= 0)"),
    ("logprobs", lambda v: isinstance(v, bool), "True or False"),
    ("top_logprobs", lambda v: _integer(v) and 0 <= v <= MAX_TOP_LOGPROBS, f"an integer in 0..{MAX_TOP_LOGPROBS}"),
    ("logit_bias", lambda v: isinstance(v, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and _integer(p[0]) and 0 <= p[0] < 2**63 and _finite(p[1])
        and -MAX_BIAS <= p[1] <= MAX_BIAS for p in v), f"a mapping of token ids (ints >= 0) to biases in "
     f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]"),
)


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 rng: np.random.Generator | None = None) -> Sampler:
    """Build ``sampler(logits [n, V]) -> [n] int64``; greedy (argmax) when temperature < GREEDY_EPS.

    Never draws from NaN: a NaN score is never chosen, and a +inf score (a penalty at an extreme)
    wins outright (the tokens at +inf share the mass); a row with no finite or +inf score is an error.
    """
    if temperature < GREEDY_EPS:
        return greedy
    rng = rng if rng is not None else np.random.default_rng()
    distribution = make_distribution(temperature, top_k, top_p, min_p)
    return lambda logits: _draw(distribution(logits), rng)


def make_distribution(temperature: float, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> Callable[[np.ndarray], np.ndarray]:
    """``probs(logits [n, V]) -> [n, V]`` float64, unnormalised: what a sampler draws from
    (temperature > 0). Speculative sampling (runtime/speculation/speculative.py) accepts drafts against it."""

    def distribution(logits: np.ndarray) -> np.ndarray:
        scores = _sane(np.asarray(logits, dtype=np.float64))  # [n, V] float64
        if top_k:
            scores = _top_k(scores, top_k)
        with np.errstate(over="ignore"):  # a difference near -1.8e308 over T < 1 is -inf: probability 0, as meant
            scores = (scores - scores.max(axis=-1, keepdims=True)) / temperature  # differences first: no +inf
        probs = _softmax(scores)  # [n, V] float64
        if min_p > 0:
            probs = np.where(probs >= min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        if top_p < 1:
            probs = _top_p(probs, top_p)
        return probs

    return distribution


def draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of probs [n, V] (unnormalised) -> [n] int64."""
    return _draw(probs, rng)


def greedy(logits: np.ndarray) -> np.ndarray:
    """argmax per row of logits [n, V] -> [n] int64, NaN never chosen."""
    logits = np.asarray(logits)
    idx = np.argmax(logits, axis=-1)  # [n]; np.argmax picks the first NaN, and +inf wins
    if np.isfinite(np.take_along_axis(logits, idx[:, None], axis=-1)).all():
        return idx.astype(np.int64)  # a finite maximum: no NaN and no inf in the row
    return np.argmax(_sane(logits.astype(np.float64)), axis=-1).astype(np.int64)


def _sane(scores: np.ndarray) -> np.ndarray:
    """Scores [n, V] float64 with NaN -> -inf, and rows holding +inf -> 0 at the +inf tokens, -inf
    elsewhere (the limit of the distribution); DecodertError for a row with nothing to choose."""
    if np.isfinite(scores).all():
        return scores
    scores = np.where(np.isnan(scores), -np.inf, scores)
    top = scores.max(axis=-1)  # [n]
    if np.isneginf(top).any():
        raise DecodertError("no token has a finite score (the logits are NaN or -inf: a damaged model, "
                            "or penalties that ruled out every token)")
    if np.isposinf(top).any():
        inf_rows = np.isposinf(top)[:, None]  # [n, 1]
        scores = np.where(inf_rows, np.where(np.isposinf(scores), 0.0, -np.inf), scores)
    return scores


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest scores per row ([n, V]); ties with the k-th score are kept too."""
    if k >= scores.shape[-1]:
        return scores
    kth = np.partition(scores, -k, axis=-1)[:, -k, None]  # [n, 1]
    return np.where(scores >= kth, scores, -np.inf)


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Row softmax in float64 ([n, V]); -inf scores get probability 0."""
    z = scores.astype(np.float64) - scores.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p ([n, V], unnormalised ok).

    Sorts only the m most likely candidates (m grows x4 until they hold top_p of the mass in
    every row), not the whole vocabulary.
    """
    probs = probs / probs.sum(axis=-1, keepdims=True)
    vocab = probs.shape[-1]
    m = min(vocab, 128)
    while True:
        cand = np.argpartition(-probs, m - 1, axis=-1)[:, :m] if m < vocab else np.argsort(-probs, axis=-1)  # [n, m]
        cand_p = np.take_along_axis(probs, cand, axis=-1)
        order = np.argsort(-cand_p, axis=-1, kind="stable")
        cand, cand_p = np.take_along_axis(cand, order, axis=-1), np.take_along_axis(cand_p, order, axis=-1)
        if m == vocab or bool((cand_p.sum(axis=-1) >= top_p).all()):
            break  # every token outside the candidates has at least top_p of mass before it
        m = min(vocab, m * 4)
    mass_before = np.cumsum(cand_p, axis=-1) - cand_p  # mass of strictly more likely tokens
    out = np.zeros_like(probs)
    np.put_along_axis(out, cand, np.where(mass_before < top_p, cand_p, 0.0), axis=-1)  # most likely always kept
    return out


def _draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of probs [n, V] (unnormalised) -> [n] int64."""
    cdf = np.cumsum(probs, axis=-1)  # [n, V]
    u = rng.random((probs.shape[0], 1)) * cdf[:, -1:]  # [n, 1]
    idx = (cdf <= u).sum(axis=-1)  # first index whose cdf exceeds u
    return np.minimum(idx, probs.shape[-1] - 1).astype(np.int64)


def make_logits_processors(repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0,
                           logit_bias: Sequence[tuple[int, float]] = ()) -> list[LogitsProcessor]:
    """Penalty and bias processors ``(token_history [T] int64, logits [..., V]) -> logits`` (only the active ones).

    The history is every token of the sequence so far (prompt and generated), as in HF
    ``repetition_penalty`` and llama.cpp's penalties. ``logit_bias`` is added last (OpenAI's meaning).
    """
    processors: list[LogitsProcessor] = []
    if repetition_penalty != 1.0:
        processors.append(_repetition(repetition_penalty))
    if presence_penalty or frequency_penalty:
        processors.append(_additive(presence_penalty, frequency_penalty))
    if logit_bias:
        processors.append(_bias(logit_bias))
    return processors


def _bias(pairs: Sequence[tuple[int, float]]) -> LogitsProcessor:
    total: dict[int, float] = {}
    for t, b in pairs:  # a repeated id adds up
        total[int(t)] = total.get(int(t), 0.0) + float(b)
    ids = np.array(list(total), dtype=np.int64)  # [B] distinct
    bias = np.array(list(total.values()), dtype=np.float64)  # [B]

    def process(history: np.ndarray, logits: np.ndarray) -> np.ndarray:
        out = np.array(logits, dtype=_dtype(logits, False), copy=True)
        out[..., ids] += bias.astype(out.dtype)
        return out

    return process


def log_softmax(row: np.ndarray) -> np.ndarray:
    """Log-probabilities [V] float64 a greedy choice is made from: log_softmax of one row's final scores
    [V] (after the structured-output mask, penalties and logit_bias). -inf: a token that cannot be chosen.
    A sampled row's are ``log_normalise`` of its ``make_distribution`` probabilities."""
    scores = _sane(np.asarray(row, dtype=np.float64)[None, :])[0]  # [V]
    z = scores - scores.max()
    with np.errstate(divide="ignore"):
        return z - np.log(np.exp(z).sum())


def top_probability(logits: np.ndarray) -> np.ndarray:
    """The softmax maximum of each row of logits [B, V] -> [B] float64 (NaN scores count as -inf; a row with
    no finite score gives 0): how sure a draft head is of its argmax."""
    scores = np.asarray(logits, dtype=np.float64)
    scores = np.where(np.isnan(scores), -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.exp(scores - top).sum(axis=-1)
    out = 1.0 / total
    return np.where(np.isfinite(top[..., 0]) & np.isfinite(out), out, 0.0)


def log_normalise(probs: np.ndarray) -> np.ndarray:
    """log(probs / sum) of unnormalised probabilities [V] (0 -> -inf)."""
    with np.errstate(divide="ignore"):
        return np.log(probs / probs.sum())


def _repetition(penalty: float) -> LogitsProcessor:
    def process(history: np.ndarray, logits: np.ndarray) -> np.ndarray:
        seen = np.unique(history)  # [U]
        if seen.size == 0:
            return logits
        out = np.array(logits, dtype=_dtype(logits, not 1e-6 <= penalty <= 1e6), copy=True)
        s = out[..., seen]
        with np.errstate(over="ignore"):  # s / 1e-300 -> +inf: the token then wins (_sane)
            out[..., seen] = np.where(s < 0, s * penalty, s / penalty)
        return out

    return process


def _dtype(logits: np.ndarray, extreme: bool) -> type:
    """float32 as the logits come, float64 for penalties far from 1 / 0 (s / 1e-300, -1e38 x 4 would
    be float32 infinities) or logits already in float64."""
    return np.float64 if extreme or np.asarray(logits).dtype == np.float64 else np.float32


def _additive(presence: float, frequency: float) -> LogitsProcessor:
    def process(history: np.ndarray, logits: np.ndarray) -> np.ndarray:
        seen, counts = np.unique(history, return_counts=True)  # [U], [U]
        if seen.size == 0:
            return logits
        out = np.array(logits, dtype=_dtype(logits, max(abs(presence), abs(frequency)) > 1e6), copy=True)
        with np.errstate(over="ignore", invalid="ignore"):  # +-inf at 1e308 penalties: handled by _sane
            out[..., seen] -= (presence + frequency * counts.astype(np.float64)).astype(out.dtype)
        return out

    return process


def apply_processors(processors: Sequence[LogitsProcessor], history: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Run processors in order over logits [..., V]."""
    for process in processors:
        logits = process(history, logits)
    return logits


_PARAM_NAMES = tuple(f.name for f in fields(SamplingParams))


def sampling_params(params: SamplingParams | None = None, **kwargs: Any) -> SamplingParams:
    """Build validated SamplingParams from keyword arguments (unknown names -> DecodertError)."""
    unknown = sorted(set(kwargs) - set(_PARAM_NAMES))
    if unknown:
        raise DecodertError(f"unknown generation parameter {unknown[0]!r}; expected one of {', '.join(_PARAM_NAMES)}")
    if params is not None:
        return SamplingParams(**{**{n: getattr(params, n) for n in _PARAM_NAMES}, **kwargs}).validate()
    return SamplingParams(**kwargs).validate()
