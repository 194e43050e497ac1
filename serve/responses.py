"""OpenAI response bodies: completions and chat completions, whole and as stream chunks, and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence as Seq

from decodert.runtime.decoding.generate import GenerationResult


class Reply:
    """The fixed part of every body of one response: id, object kind, created, model."""

    def __init__(self, kind: str, model: str, logprobs: Any = None) -> None:
        self.chat = kind == "chat"
        self.logprobs = logprobs  # a serve/logprobs.py LogprobFormat when the request asked for logprobs
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses ------------------------------------------------------------------
    def body(self, results: Seq[GenerationResult], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self._choice(j, r) for j, r in enumerate(results)]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices, "usage": usage}

    def _choice(self, j: int, r: GenerationResult) -> dict[str, Any]:
        logprobs = self._logprobs(j, r.logprobs or ())
        if self.chat:
            return {"index": j, "message": {"role": "assistant", "content": r.text}, "logprobs": logprobs,
                    "finish_reason": r.finish_reason}
        return {"index": j, "text": r.text, "logprobs": logprobs, "finish_reason": r.finish_reason}

    def _logprobs(self, j: int, entries: Seq[Any] | None) -> dict[str, Any] | None:
        return None if self.logprobs is None or entries is None else self.logprobs.body(j, entries)

    # -- stream chunks ----------------------------------------------------------------------
    def chunk(self, j: int, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              usage: bool = False, logprobs: Seq[Any] | None = None) -> dict[str, Any]:
        """One chunk for choice ``j``: text (with its tokens' ``logprobs`` entries), or the role opener
        (chat), or the finish reason.

        With ``usage`` (stream_options.include_usage) every chunk carries ``"usage": null``.
        """
        lp = self._logprobs(j, logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": j, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": j, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage}


def usage(prompt_lengths: Seq[int], results: Seq[GenerationResult]) -> dict[str, Any]:
    """Token counts: each prompt once (even with n > 1), every choice's generated tokens, prefix-cache hits."""
    completion = sum(len(r.token_ids) for r in results)
    cached = sum(int(getattr(r.metrics, "cached_tokens", 0) or 0) for r in results)
    prompt = sum(prompt_lengths)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
