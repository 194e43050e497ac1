"""Type checks at the public API boundary (``LLM.generate`` / ``stream`` / ``chat`` / ``generate_many``
/ ``encode``): a wrong value ends in one DecodertError naming the argument and what it accepts,
never in a traceback from deep inside the tokenizer, numpy or the scheduler.

A prompt is text (``str``, valid Unicode: no lone surrogates), or token ids: a list/tuple of ints
or a 1-D integer numpy array, each id in [0, 2**63). A batch is a non-empty list/tuple of prompts
(or a 2-D integer array, one prompt per row). ``bytes``/``bytearray``, floats, bools and lists
that mix text and ids are refused rather than guessed at.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from decodert.errors import DecodertError

PROMPT_TYPES = "a str, or token ids (a list of ints or a 1-D integer numpy array)"
BATCH_TYPES = f"a prompt ({PROMPT_TYPES}) or a non-empty list of prompts"
_INT64_END = 1 << 63


def _kind(value: Any) -> str:
    return type(value).__name__


def is_token_id(value: Any) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_batch(prompt: Any) -> bool:
    """True for a list of prompts, False for one prompt; DecodertError for anything else."""
    if isinstance(prompt, str):
        return False
    if isinstance(prompt, np.ndarray):
        if prompt.ndim in (1, 2):
            return prompt.ndim == 2
        raise DecodertError(f"prompt: a numpy array must be 1-D (one prompt) or 2-D (a batch), got {prompt.ndim}-D")
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise DecodertError(f"prompt is an empty {_kind(prompt)}; expected {BATCH_TYPES}")
        if all(is_token_id(t) for t in prompt):
            return False
        if all(isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt):
            return True
        bad = next(i for i, p in enumerate(prompt) if not isinstance(p, (str, list, tuple, np.ndarray)))
        raise DecodertError(f"prompt: item {bad} is a {_kind(prompt[bad])} ({prompt[bad]!r:.40}) in a list that is "
                            "neither token ids (all ints) nor a batch of prompts (all str or id lists)")
    check_prompt(prompt)  # bytes, numbers, None...: its message names the type
    raise DecodertError(f"prompt is a {_kind(prompt)}; expected {BATCH_TYPES}")


def check_text(text: str, what: str = "prompt") -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DecodertError(f"{what} holds a lone surrogate {text[e.start]!r} at character {e.start}: not valid "
                            "text (decode bytes with errors='replace' or 'surrogateescape' -> fix the source)") from None
    return text


def token_ids(prompt: Any, what: str = "prompt") -> np.ndarray:
    """Token ids [L] int64 from a list/tuple of ints or an integer array; DecodertError otherwise."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise DecodertError(f"{what}: a numpy array of token ids must be 1-D with an integer dtype, "
                                f"got {prompt.ndim}-D {prompt.dtype}")
        if prompt.dtype == np.uint64 and prompt.size and int(prompt.max()) >= _INT64_END:
            raise DecodertError(f"{what}: token id {int(prompt.max())} is not below 2**63")
        return prompt.astype(np.int64)
    if not isinstance(prompt, (list, tuple)):
        raise DecodertError(f"{what} is a {_kind(prompt)}; expected {PROMPT_TYPES}")
    for i, t in enumerate(prompt):
        if not is_token_id(t):
            raise DecodertError(f"{what}: token id {i} is a {_kind(t)} ({t!r:.40}); token ids must be ints")
        if not 0 <= int(t) < _INT64_END:
            raise DecodertError(f"{what}: token id {i} ({int(t)}) is negative or not below 2**63")
    return np.asarray([int(t) for t in prompt], dtype=np.int64)


def check_prompt(prompt: Any, what: str = "prompt") -> str | np.ndarray:
    """One prompt: checked text, or ids [L] int64."""
    if isinstance(prompt, str):
        return check_text(prompt, what)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise DecodertError(f"{what} is {_kind(prompt)}; decode it to str first (or pass token ids as a list of ints)")
    return token_ids(prompt, what)


def check_request(req: Any, i: int, request_type: type) -> None:
    """A ``generate_many`` item is a Request or a mapping."""
    from collections.abc import Mapping

    if not isinstance(req, (request_type, Mapping)):
        raise DecodertError(f"request {i} is a {_kind(req)}; expected a Request or a dict with 'prompt' "
                            "or 'messages' (and generation parameters)")


def check_sequence_arg(value: Any, what: str) -> None:
    """A list argument (requests, messages) must be a list or tuple, not a str, a dict or a number."""
    if not isinstance(value, (list, tuple)):
        raise DecodertError(f"{what} is a {_kind(value)}; expected a non-empty list")


def load_json(text: str, what: str) -> Any:
    """``json.loads(text)`` with every failure one DecodertError naming ``what``: malformed JSON, nesting deeper
    than Python's recursion limit allows (``"[" * 100000``: RecursionError), an integer of more digits than
    Python converts (``sys.get_int_max_str_digits()``, 4300: ValueError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DecodertError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise DecodertError(f"{what} is nested too deeply to read (beyond Python's recursion limit)") from None
    except ValueError:  # only the integer-digits limit: JSONDecodeError is caught above
        raise DecodertError(f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits "
                            "(the limit)") from None


CHARS_PER_TOKEN = 64  # a prompt longer than this many characters per token of max_seq cannot fit
PIECE = 1 << 20  # text is tokenized in pieces of at most this many characters


def encode_text(tokenizer: Any, text: str, max_seq: int, what: str = "prompt") -> list[int]:
    """Token ids of ``text``; refused before tokenizing when it cannot fit in ``max_seq`` tokens.

    Long text is tokenized in pieces of PIECE characters cut before a newline or space (where a
    byte-level BPE pre-tokenizer splits anyway), so the tokenizer never sees one huge string.
    """
    if len(text) > max_seq * CHARS_PER_TOKEN:
        raise DecodertError(f"{what} has {len(text):,} characters: far more than the {max_seq} tokens the model "
                            f"was exported for (--max-seq) can hold")
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= PIECE else _cut(text, start, start + PIECE)
        try:
            ids.extend(tokenizer.encode(text[start:end], add_special_tokens=False).ids)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a Rust panic in tokenizers is a BaseException
            raise DecodertError(f"the tokenizer failed on {what} ({type(e).__name__}: {str(e)[:120]})") from None
        start = end
    return ids


def _cut(text: str, start: int, end: int) -> int:
    """Where to end the piece text[start:end]: before its last newline, else its last space."""
    for sep in ("\n", " "):
        i = text.rfind(sep, start + 1, end)
        if i > start:
            return i
    return end
