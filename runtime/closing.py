"""Structured output that always parses: strict schemas, and closing the output within the token budget.

Strict mode (OpenAI's ``strict: true``, decodert's default for ``response_format`` json_schema and for
tool parameters): ``strict_schema`` adds ``additionalProperties: false`` to every object schema that
lists ``properties`` and says nothing about other keys (not where ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref``
sit beside them: llguidance intersects those, so a closed parent would refuse their keys), and ``STRICT_JSON`` asks llguidance for
compact JSON (its ``x-guidance`` options: no free whitespace, "," and ":" separators).

Budget: ``Closer.path(matcher, limit)`` finds a short way to finish the grammar from a matcher's
state: it takes the tokens llguidance forces (``compute_ff_tokens``), and where there is a choice
the first allowed of a few closing tokens (``"`` ``}`` ``]`` ``0`` ...), else the allowed token with
the lowest id (a single byte in byte-level BPE vocabularies); eos last when the grammar accepts.
That choice depends on the allowed-token mask alone, so a mask met again on the path would repeat
itself (an email's local part takes ``}`` or ``0`` forever, a URI's path ``0``: no closing ``"`` ever
comes). There the closer escapes: it takes the first single printable character (closers first,
then in ASCII order) after which the mask is one the path has not met (``@`` in an email, ``.`` in its
domain, ``:`` after a URI's scheme), and goes on; where none gives a new mask it keeps its choice. So
every string ``format`` llguidance accepts (email, uri, duration, uuid, date-time, ipv4/6, hostname,
...) closes within a budget that holds its shortest value.
``Guide.fit`` (runtime/constraints.py) uses it to refuse a token after which no such path fits the
remaining ``max_tokens``, and then follows the path: the output closes, and finish_reason is "length".
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from decodert.errors import DecodertError

STRICT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
CLOSERS = ('"', "}", "]", "0", "a", "null", "false", ":", ",", " ")  # tried in this order where a choice is free
_COMBINATORS = ("anyOf", "oneOf")


def strict_schema(schema: Mapping[str, Any] | bool, compact: bool = False) -> Any:
    """``schema`` with unlisted properties refused (see the module docstring); ``compact``: also the
    ``x-guidance`` of ``STRICT_JSON`` at the top unless the schema has its own."""
    try:
        out = _closed(schema, True)
    except RecursionError:
        raise DecodertError("json_schema is nested too deeply") from None
    if compact and isinstance(out, dict) and "x-guidance" not in out:
        out["x-guidance"] = dict(STRICT_JSON)
    return out


def _closed(node: Any, close: bool) -> Any:
    if isinstance(node, list):
        return [_closed(v, close) for v in node]
    if not isinstance(node, Mapping):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            out[key] = {k: _closed(v, True) for k, v in value.items()} if isinstance(value, Mapping) else value
        elif key == "allOf":  # branches merge: closing one would refuse the others' keys
            out[key] = _closed(value, False)
        elif key in ("items", "prefixItems", "additionalProperties", "not", "contains", *_COMBINATORS):
            out[key] = _closed(value, True)
        else:
            out[key] = value
    merged = any(k in out for k in ("allOf", "$ref", *_COMBINATORS))  # siblings intersect: keep their keys
    if close and not merged and "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


class Closer:
    """Short completions of a grammar for one tokenizer (built once per Guidance)."""

    def __init__(self, lltokenizer: Any, vocab_size: int, eos: int) -> None:
        self.eos = int(eos)
        self.words = (vocab_size + 31) // 32
        ids = [lltokenizer.tokenize_str(s) for s in CLOSERS]
        self.closers = [t[0] for t in ids if len(t) == 1 and t[0] < vocab_size]
        chars = [lltokenizer.tokenize_str(chr(c)) for c in range(33, 127)]  # the escape alphabet: printable ASCII
        singles = [t[0] for t in chars if len(t) == 1 and t[0] < vocab_size]
        self.escapes = list(dict.fromkeys(self.closers + singles))  # closers first, then ASCII order

    def path(self, matcher: Any, limit: int) -> list[int] | None:
        """Tokens that complete the grammar from ``matcher``'s state (unchanged), at most ``limit``; None if not found."""
        m = matcher.deep_copy()
        mask = np.zeros(self.words, np.int32)  # [words]
        out: list[int] = []
        seen: set[bytes] = set()  # the masks met on this path
        while len(out) <= limit:
            if m.is_stopped():
                return out
            forced = m.compute_ff_tokens()
            if forced:
                if not m.consume_tokens(forced):
                    return None
                out += forced
                continue
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if m.is_accepting() and self._allowed(mask, self.eos):
                return out + [self.eos] if len(out) < limit else None
            key = mask.tobytes()
            token = self._escape(m, mask, seen) if key in seen else None
            seen.add(key)
            if token is None:
                token = next((t for t in self.closers if self._allowed(mask, t)), None)
            if token is None:
                bits = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
                if bits.size == 0:
                    return None
                token = int(bits[0])
            if not m.consume_token(token):
                return None
            out.append(token)
        return None

    def _escape(self, m: Any, mask: np.ndarray, seen: set[bytes]) -> int | None:
        """The first allowed escape character after which the mask is new to the path (None: none is)."""
        child = np.zeros_like(mask)
        for t in self.escapes:
            if not self._allowed(mask, t):
                continue
            after = m.deep_copy()
            if not after.consume_token(t):
                continue
            after.unsafe_compute_mask_ptr(child.ctypes.data, child.nbytes)
            if child.tobytes() not in seen:
                return t
        return None

    @staticmethod
    def _allowed(mask: np.ndarray, token: int) -> bool:
        return bool((int(mask[token >> 5]) >> (token & 31)) & 1)
