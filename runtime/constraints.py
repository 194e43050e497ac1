"""Structured output: JSON-schema, regex and Lark-grammar constraints, through llguidance.

    c = Constraint.of(json_schema={"type": "object", ...})   # or regex=..., grammar=... (Lark)
    guide = Guidance.for_tokenizer(tokenizer, vocab, eos).guide(c)   # one per sequence
    logits = guide.mask_logits(logits)      # [V]: tokens the grammar forbids -> -inf
    guide.advance(token)                    # after the token is chosen; guide.finished at the end

- ``Constraint`` is the request-level spec (frozen, hashable, no tokenizer): the API, the CLI and
  the server build one from json_schema / regex / grammar / an OpenAI ``response_format``.
- ``Guidance`` holds the ``llguidance.LLTokenizer`` built once from the artifact's tokenizer.json
  (with the logits' width as its vocabulary and the artifact's eos ids) and compiles
  constraints into matchers; a compiled matcher is kept per constraint and copied per row.
- ``Guide`` is one row's state: its ``LLMatcher`` and its allowed-token bitmask for the next
  step, ``mask`` [ceil(V/32)] int32, bit t = token t allowed. ``mask_overlap.masks_ahead(seqs)`` fills the
  bitmasks of a batch on a worker thread while the backend's step runs (ONNX Runtime and the
  llguidance mask computation both release the GIL) when the last step's masks took at least
  ``OVERLAP_MIN_S`` (1 ms: cheaper ones are not worth running beside the backend); a guide whose
  mask is stale computes it when it is needed, so the overlap is a speed-up only, never a
  condition for correctness.
- Speculative decoding: ``guide.check(tokens)`` says how many tokens of a draft run the grammar
  accepts (the rest is cut before verification); ``draft_masks(tokens)`` gives the mask at every
  verified position; ``advance_many`` / ``rollback`` move the state.

Special tokens: a schema whose output must spell a special token's text (a ``const`` / ``enum`` value or a
property name holding ``<|im_end|>``, in a json_schema or in a tool's parameters) is refused when it is
compiled, in one line: the text would tokenize to the special token, which the grammar cannot take.

JSON whitespace: by default each place where JSON allows whitespace takes ``JSON_WHITESPACE``:
one line break and an indentation of up to 24 spaces or 6 tabs, or 1-2 spaces, so a small model
cannot loop on blank lines or tabs (seen with SmolLM2 under llguidance's default, any whitespace). A
schema's top-level ``"x-guidance"`` key overrides it (llguidance's options, docs/STRUCTURED.md).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from decodert.errors import DecodertError, MissingDependencyError, first_line
from decodert.runtime.closing import Closer, strict_schema

KINDS = ("json_schema", "regex", "grammar")
JSON_WHITESPACE = r"(?:\r?\n(?: {1,24}|\t{1,6})?| {1,2})"  # one line break (+ indentation), or 1-2 spaces
MAX_MESSAGE = 300  # characters of llguidance's message quoted in an error (it may quote a whole schema)
_COMPILED_KEEP = 32  # compiled matchers kept per Guidance (one per distinct constraint)
CLOSE_ZONE = 32  # Guide.fit checks the closing path once the budget is within 2 x its length + this


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` is "json_schema" | "regex" | "grammar"."""

    kind: str
    text: str  # the schema as JSON text, the regex, or the Lark grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DecodertError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text:
            raise DecodertError(f"a {self.kind} constraint needs non-empty text, got {self.text!r:.40}")

    @classmethod
    def of(cls, json_schema: Mapping[str, Any] | str | bool | None = None, regex: str | None = None,
           grammar: str | None = None) -> "Constraint | None":
        """The constraint the keyword arguments ask for (None when none is given; one at most)."""
        given = [(k, v) for k, v in zip(KINDS, (json_schema, regex, grammar)) if v is not None]
        if not given:
            return None
        if len(given) > 1:
            raise DecodertError(f"give at most one of json_schema, regex or grammar (got {', '.join(k for k, _ in given)})")
        kind, value = given[0]
        if kind == "json_schema":
            return cls("json_schema", _schema_text(value))
        if not isinstance(value, str) or not value:
            raise DecodertError(f"{kind} must be a non-empty string, got {type(value).__name__} {value!r:.40}")
        return cls(kind, value)

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI ``response_format={"type": "json_object"}``)."""
        return cls("json_schema", '{"type": "object"}')

    @classmethod
    def from_response_format(cls, fmt: Mapping[str, Any] | None) -> "Constraint | None":
        """An OpenAI ``response_format``: {"type": "text"} | {"type": "json_object"} |
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, Mapping) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise DecodertError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            if spec.get("strict") is False:
                return cls.of(json_schema=spec["schema"])
            schema = json.loads(_schema_text(spec["schema"]))  # strict unless it says "strict": false (runtime/closing.py)
            return cls.of(json_schema=strict_schema(schema, compact=True) if isinstance(schema, dict) else schema)
        raise DecodertError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def grammar_text(self) -> str:
        """The llguidance grammar (JSON text) for this constraint; not yet checked."""
        import llguidance

        if self.kind == "json_schema":
            schema = json.loads(self.text)
            own = schema.get("x-guidance") if isinstance(schema, dict) else None
            if isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own):
                return llguidance.LLMatcher.grammar_from_json_schema(self.text)  # the schema's own whitespace rule
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults={"whitespace_pattern": JSON_WHITESPACE})
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


def _schema_text(value: Any) -> str:
    """A JSON schema (dict, bool, or JSON text of one) -> canonical JSON text."""
    deep = "json_schema is nested too deeply (beyond Python's recursion limit); flatten it or use $defs"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DecodertError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise DecodertError(deep) from None
    if not isinstance(value, (Mapping, bool)):
        raise DecodertError(f"json_schema must be a JSON object (a schema), got {type(value).__name__}")
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise DecodertError(f"json_schema cannot be written as JSON: {e}") from None
    except RecursionError:
        raise DecodertError(deep) from None


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MissingDependencyError("structured output (json_schema / regex / grammar) needs llguidance, a dependency "
                                     "of decodert that is missing here: pip install 'llguidance>=1.9,<2'") from None
    return llguidance


def check_text(c: Constraint) -> None:
    """Parse ``c``'s schema / regex / grammar without a tokenizer (llguidance's ``validate_grammar``):
    a one-line DecodertError when it is invalid. ``Guidance.compile`` checks more, for a model."""
    llguidance = _llguidance()  # MissingDependencyError with the install hint
    try:
        problem = llguidance.LLMatcher.validate_grammar(c.grammar_text())
    except Exception as e:  # llguidance raises ValueError / RuntimeError with a multi-line message
        problem = str(e)
    if problem:
        raise DecodertError(_describe_error(c, problem))


def _describe_error(c: Constraint, message: str) -> str:
    """llguidance's (multi-line) compile error -> one line naming what was wrong."""
    lines = [" ".join(x.split()) for x in message.splitlines() if x.strip()] or ["unknown error"]
    line = lines[0]
    detail = next((x[len("error:"):].strip() for x in lines if x.startswith("error:")), None)  # regex crate's reason
    if detail:
        line = re.sub(r":? ?regex parse error:?$", "", line)
        line = f"{line}: {detail}" if line else f"regex parse error: {detail}"
    if c.kind == "regex":  # drop the position in llguidance's wrapper grammar and the repeated 'invalid regex'
        line = re.sub(r'^(at \d+\(\d+\): )?invalid regex (".*") \(in regex\)', r"\2", line)
    remote = re.search(r"Resource '(.*?)' is not present in a registry", line)
    if remote:
        return f"unsupported JSON schema: $ref to {remote.group(1)} (only references inside the schema, like #/$defs/x, are resolved)"
    unimplemented = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if unimplemented:
        return f"unsupported JSON schema: llguidance does not implement the keyword(s) {unimplemented.group(1)}"
    if c.kind == "json_schema" and "Unknown format" in line:
        return f"unsupported JSON schema: {line}"
    what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "Lark grammar"}[c.kind]
    return f"invalid {what}: {line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE] + '...'}"


def _special_texts(tokenizer_json: str) -> tuple[str, ...]:
    """The text of the tokenizer's special added tokens (two characters or more)."""
    try:
        added = json.loads(tokenizer_json).get("added_tokens") or []
    except (json.JSONDecodeError, AttributeError):
        return ()
    return tuple(t["content"] for t in added if isinstance(t, dict) and t.get("special") and len(t.get("content") or "") > 1)


def _written_strings(schema: Any) -> list[str]:
    """Strings a JSON schema makes the output write verbatim: const and enum values, property names."""
    out: list[str] = []

    def values(v: Any) -> None:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, list):
            for x in v:
                values(x)
        elif isinstance(v, dict):
            for k, x in v.items():
                out.append(k)
                values(x)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for k, v in node.items():
                if k in ("const", "enum"):
                    values(v)
                elif k == "properties" and isinstance(v, dict):
                    out.extend(v)
                    walk(list(v.values()))
                elif k not in ("default", "examples", "description", "title"):
                    walk(v)

    walk(schema)
    return out


def _schemas_in(c: Constraint) -> list[Any]:
    """The JSON schemas of a constraint: a json_schema's, and each ``%json {...}`` of a Lark grammar (tools)."""
    if c.kind == "json_schema":
        return [json.loads(c.text)]
    if c.kind != "grammar":
        return []
    out, decoder, at = [], json.JSONDecoder(), c.text.find("%json")
    while at >= 0:
        start = c.text.find("{", at)
        try:
            value, end = decoder.raw_decode(c.text, start) if start >= 0 else (None, at + 5)
            out.append(value)
        except (json.JSONDecodeError, RecursionError):
            end = at + 5
        at = c.text.find("%json", end)
    return out


def _refuse_special_text(c: Constraint, specials: Sequence[str]) -> None:
    if not specials:
        return
    try:
        written = [w for schema in _schemas_in(c) for w in _written_strings(schema)]
    except RecursionError:
        return  # llguidance refuses it in its own words
    for text in written:
        token = next((t for t in specials if t in text), None)
        if token is not None:
            raise DecodertError(f"unsupported JSON schema: the output would have to spell {text[:60]!r}, which holds "
                                f"this model's special token {token!r}; constrained output cannot write special tokens as text")


class Guidance:
    """The llguidance tokenizer of one model, and the constraints compiled for it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        llg = _llguidance()
        if not eos_token_ids:
            raise DecodertError("structured output needs the model's eos token, and the artifact's manifest lists none")
        try:
            self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=int(vocab_size), eos_token=[int(t) for t in eos_token_ids])
        except Exception as e:  # llguidance raises ValueError/RuntimeError on tokenizers it cannot read
            raise DecodertError(f"llguidance cannot use this model's tokenizer: {first_line(e)}") from None
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32  # int32 words per bitmask
        self.closer = Closer(self.tokenizer, self.vocab_size, int(eos_token_ids[0]))  # budget-aware closing
        self.specials = _special_texts(tokenizer_json)  # special tokens' text, which constrained output cannot spell
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> "Guidance":
        """From a ``tokenizers.Tokenizer`` (its JSON without padding or truncation)."""
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(tokenizer.to_str())
        copy.no_padding()
        copy.no_truncation()
        return cls(copy.to_str(), vocab_size, eos_token_ids)

    def compile(self, c: Constraint) -> Any:
        """A fresh ``LLMatcher`` at the start of ``c``; DecodertError (one line) if ``c`` is invalid."""
        with self._lock:
            base = self._compiled.get(c)
            if base is not None:
                self._compiled.move_to_end(c)
                return base.deep_copy()
        llg = _llguidance()
        _refuse_special_text(c, self.specials)
        try:
            grammar = c.grammar_text()
        except ValueError as e:
            raise DecodertError(_describe_error(c, str(e))) from None
        base = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if base.is_error():
            raise DecodertError(_describe_error(c, base.get_error()))
        for _ in range(2):  # compiled fully: some grammars fail only at a first mask ({"$ref": "#"}), or at the
            first = base.deep_copy()  # second row's ("a{1000000}": the shared lexer's budget is spent by then);
            first.compute_bitmask()  # so they are the request's error (a 400), not a failed step (a 500)
            if first.is_error():
                raise DecodertError(_describe_error(c, first.get_error()))
        with self._lock:
            self._compiled[c] = base
            while len(self._compiled) > _COMPILED_KEEP:
                self._compiled.popitem(last=False)
        return base.deep_copy()

    def guide(self, c: Constraint) -> "Guide":
        return Guide(self.compile(c), self.vocab_size, self.closer)


class Guide:
    """One row's constraint state: the matcher, and the allowed-token bitmask for its next token."""

    def __init__(self, matcher: Any, vocab_size: int, closer: Closer | None = None) -> None:
        self.matcher = matcher
        self.closer = closer  # None: no budget-aware closing
        self.cut = False  # the output was closed early to fit max_tokens (finish_reason "length")
        self.forced = False  # the last token ``fit`` gave came from a closing path, not from the model's draw
        self._need: int | None = None  # tokens the last closing path took
        self._path: list[int] = []  # the closing path being followed
        self.vocab_size = vocab_size
        self.mask = np.zeros((vocab_size + 31) // 32, np.int32)  # [words] bit t of word t//32 = token t allowed
        self.stale = True  # the mask is not yet computed for the current state
        self.mask_s = float("inf")  # how long the last mask took (s); unknown at first: overlap it

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but eos may follow (the row can end here)."""
        return bool(self.matcher.is_stopped())

    def compute_mask(self) -> None:
        """Fill ``mask`` for the current state (releases the GIL while it runs)."""
        start = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self.stale, self.mask_s = False, time.perf_counter() - start
        self._raise_if_error()

    def set_mask(self, mask: np.ndarray, seconds: float) -> None:
        """Take a mask computed for the current state elsewhere (runtime/mask_overlap.py: several rows at once)."""
        self.mask, self.stale, self.mask_s = mask, False, seconds
        self._raise_if_error()

    def allowed(self) -> np.ndarray:
        """[V] bool: tokens the grammar allows next."""
        if self.stale:
            self.compute_mask()
        bits = np.unpackbits(self.mask.view(np.uint8), bitorder="little")  # [32 * words] 0/1
        return bits[: self.vocab_size].astype(bool)

    def allows(self, token: int) -> bool:
        """Whether one token is allowed next (a bit test, no [V] work)."""
        if self.stale:
            self.compute_mask()
        return 0 <= token < self.vocab_size and bool((int(self.mask[token >> 5]) >> (token & 31)) & 1)

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] (or [n, V]) with the forbidden tokens set to -inf (a new array)."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, token: int) -> None:
        """Consume the chosen token (it must be allowed: the mask was applied)."""
        if not self.matcher.consume_token(int(token)):
            self._raise_if_error()
            raise DecodertError(f"the constraint rejected token {token}")
        self.stale = True

    def fit(self, token: int, budget: int) -> int:
        """``token`` if a complete output can still follow it within ``budget`` tokens (this one
        included); else the next token of a closing path (runtime/closing.py), and ``cut`` is set."""
        self.forced = False
        if self.closer is None:
            return token
        if self._path:
            self.forced = True
            return self._path.pop(0)
        if self._need is None:
            found = self.closer.path(self.matcher, 4096)
            self._need = len(found) if found is not None else 0
        if budget > 2 * self._need + CLOSE_ZONE:
            return token
        after = self.matcher.deep_copy()
        found = self.closer.path(after, budget - 1) if after.consume_token(int(token)) else None
        if found is not None:
            self._need = len(found) + 1
            return token
        path = self.closer.path(self.matcher, budget)
        if not path:  # no completion fits at all: let the model go on
            return token
        self.cut, self._path, self.forced = True, path[1:], True
        return path[0]

    # -- speculative decoding: check a draft run, commit or take back tokens --------------------
    def check(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a candidate run the grammar accepts (state unchanged)."""
        return int(self.matcher.validate_tokens([int(t) for t in tokens]))

    def draft_masks(self, tokens: Sequence[int]) -> np.ndarray:
        """[k+1, words] int32: the mask before each of the k draft tokens and after the last, for
        choosing each verified position's token under the grammar (state unchanged). The tokens
        must be ones ``check`` accepted."""
        out = np.zeros((len(tokens) + 1, self.mask.size), np.int32)  # [k+1, words]
        for i in range(len(tokens) + 1):
            if i:
                self.advance(tokens[i - 1])
            self.compute_mask()
            out[i] = self.mask
        self.rollback(len(tokens))
        self.mask[:], self.stale = out[0], False  # back at the first position, whose mask is known
        return out

    def advance_many(self, tokens: Sequence[int]) -> None:
        """Consume a run of tokens ``check`` accepted."""
        for t in tokens:
            self.advance(t)

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` consumed tokens (rejected draft tokens)."""
        if n and not self.matcher.rollback(int(n)):
            raise DecodertError(f"the constraint cannot take back {n} tokens")
        self.stale = True

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise DecodertError(f"structured output failed: {first_line(RuntimeError(self.matcher.get_error()))}")
