"""OpenAI response bodies: completions and chat completions, whole and as stream chunks, and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence as Seq

from decodert.runtime.chat.output import assemble
from decodert.runtime.chat.turn import call_finish
from decodert.runtime.decoding.generate import GenerationResult


class Reply:
    """The fixed part of every body of one response: id, object kind, created, model."""

    def __init__(self, kind: str, model: str, logprobs: Any = None, turn: Any = None, prompt: str = "") -> None:
        self.chat = kind == "chat"
        self.logprobs = logprobs  # a serve/protocols/logprobs.py LogprobFormat when the request asked for logprobs
        self.turn = None if turn is None or turn.plain else turn  # a chat turn whose replies are split
        self.prompt = prompt  # the rendered chat prompt (it may open <think>)
        self._outputs: dict[int, Any] = {}  # choice -> its ChatOutput (streams)
        self._called: dict[int, list] = {}  # choice -> the tool-call deltas it streamed
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
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            if self.turn is not None:
                r = self.turn.finish(r, self.prompt)
                message["content"] = r.text if r.text or not r.tool_calls else None
                if r.reasoning is not None:
                    message["reasoning_content"] = r.reasoning
                if r.tool_calls:
                    message["tool_calls"] = r.tool_calls
            return {"index": j, "message": message, "logprobs": logprobs, "finish_reason": r.finish_reason}
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

    def text_chunks(self, j: int, text: str, usage: bool = False, logprobs: Seq[Any] | None = None) -> list[dict[str, Any]]:
        """The chunks for a text delta of choice ``j``: as it is, or split (content, reasoning, tool calls);
        the delta's tokens' ``logprobs`` entries ride on the last of them (on an empty delta if none)."""
        if self.turn is None:
            return [self.chunk(j, text, usage=usage, logprobs=logprobs)]
        out = self._outputs.setdefault(j, self.turn.output(self.prompt))
        chunks = [self._delta_chunk(j, d, usage) for d in out.feed(text)] if text else []
        if logprobs:
            if not chunks:
                chunks = [self.chunk(j, usage=usage)]
            chunks[-1]["choices"][0]["logprobs"] = self._logprobs(j, logprobs)
        return chunks

    def end_chunks(self, j: int, finish_reason: str, usage: bool = False) -> list[dict[str, Any]]:
        """What is left of choice ``j``'s split text, then its finish reason ("tool_calls" after complete calls)."""
        chunks = []
        if self.turn is not None:
            out = self._outputs.setdefault(j, self.turn.output(self.prompt))
            chunks = [self._delta_chunk(j, d, usage) for d in out.finish()]
            if j in self._called:  # "tool_calls" when its calls are complete (runtime/chat/turn.py call_finish)
                finish_reason = call_finish(finish_reason, assemble(self._called[j])[2])
        return chunks + [self.chunk(j, finish_reason=finish_reason, usage=usage)]

    def _delta_chunk(self, j: int, d: Any, usage: bool) -> dict[str, Any]:
        out = self.chunk(j, usage=usage)
        if d.kind == "tool":
            self._called.setdefault(j, []).append(d)
            call: dict[str, Any] = {"index": d.index, "function": {"arguments": d.text}}
            if d.id is not None:
                call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.text})
            out["choices"][0]["delta"] = {"tool_calls": [call]}
        else:
            out["choices"][0]["delta"] = {"reasoning_content" if d.kind == "reasoning" else "content": d.text}
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
