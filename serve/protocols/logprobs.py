"""OpenAI ``logprobs`` objects from the runtime's TokenLogprob entries (runtime/decoding/generate.py).

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}], "refusal": null}``. Completions (the legacy shape): ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}``. A token's text is the tokenizer's decoding
of that token alone (special tokens included, so a final eos shows); ``bytes`` are its UTF-8
bytes. A log-probability of -inf (a token the sampled distribution rules out; never a chosen
one in practice) is written as -9999.0, as OpenAI does, since JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any, Sequence as Seq

IMPOSSIBLE = -9999.0


class LogprobFormat:
    """Formats one response's logprobs: chat or completions; per choice for completions' text_offset."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self._text: dict[int, str] = {}
        self._offset: dict[int, int] = {}  # choice -> characters of token text so far (completions, streams)

    def token(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
        return text

    def body(self, j: int, entries: Seq[Any]) -> dict[str, Any]:
        """The logprobs object of choice ``j`` for these tokens (a whole choice, or one stream chunk's)."""
        return self._chat(entries) if self.chat else self._completion(j, entries)

    def _chat(self, entries: Seq[Any]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

        content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def _completion(self, j: int, entries: Seq[Any]) -> dict[str, Any]:
        tokens = [self.token(e.token_id) for e in entries]
        offsets = []
        at = self._offset.get(j, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self._offset[j] = at
        tops = [{self.token(t): _finite(lp) for t, lp in e.top} for e in entries]
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries], "top_logprobs": tops,
                "text_offset": offsets}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE


def logprob_format(req: Any, tokenizer: Any, chat: bool) -> LogprobFormat | None:
    """The formatter when the request asked for logprobs (chat ``logprobs: true``; completions ``logprobs: N``)."""
    asked = req.logprobs is True if chat else req.logprobs is not None
    return LogprobFormat(tokenizer, chat) if asked else None
