"""One chat turn for the protocols that are not chat completions (the Responses API, Anthropic Messages): a
``ChatCompletionRequest`` the protocol translated its request into, run on the engine, its reply split.

    run = await ChatRun.start(engine, chat_request, speculative, adapter, observe)   # 400 / 429 / 503 here
    reply = await run.whole(request)                  # TurnReply: content, reasoning, tool calls, counts
    async for delta in run.deltas(): ...              # Delta("content" | "reasoning" | "tool") as they come
    reply = run.reply                                 # after deltas() ended

The chat path does the work: the template, tools and thinking (runtime/chat/turn.py), the constraint
(tool_choice, response_format), the splitting of the reply (runtime/chat/output.py: the same parser as
chat completions, streamed or not), and the engine job (serve/jobs.py). A protocol maps ``TurnReply`` and the
deltas onto its own wire shapes; it never parses model text itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool

from decodert.runtime.chat.output import Delta, assemble
from decodert.runtime.chat.turn import call_finish
from decodert.runtime.engine.request import Prepared
from decodert.runtime.engine.thread import EngineThread
from decodert.serve.jobs import Job, chat_choices


@dataclass
class TurnReply:
    """A finished turn, split: what every protocol's body is made of."""

    content: str  # the answer's text ("" when the reply is only calls)
    reasoning: str | None  # the model's thinking (<think>... or harmony's analysis), apart from the content
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI chat shape [{id, type, function: {name, arguments}}]
    finish_reason: str = "stop"  # "stop" | "length" | "tool_calls"
    input_tokens: int = 0  # the rendered prompt's tokens
    output_tokens: int = 0  # generated tokens (a final eos included)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    reasoning_tokens: int = 0  # the reasoning text's tokens (re-encoded: the engine does not label tokens)
    stop_sequence: str | None = None  # the stop string that ended the reply (None: another end)


class ChatRun:
    """One chat turn on the engine (one choice): its prepared prompt and its job."""

    def __init__(self, engine: EngineThread, prepared: Prepared, job: Job) -> None:
        self.engine, self.prepared, self.job = engine, prepared, job
        turn = prepared.turn
        self._turn = None if turn is None or turn.plain else turn
        self._deltas: list[Delta] = []
        self.reply: TurnReply | None = None  # set when the turn ended (whole() or the end of deltas())

    @classmethod
    async def start(cls, engine: EngineThread, chat: Any, speculative: Any = None, adapter: str | None = None,
                    observe: Any = None) -> "ChatRun":
        """Prepare ``chat`` (a checked ChatCompletionRequest with n = 1) in a worker thread and submit it."""
        received = time.perf_counter()
        prepared, choices = await run_in_threadpool(chat_choices, engine, chat, speculative, adapter)
        return cls(engine, prepared, Job(engine, choices, received, observe))

    async def whole(self, request: Any) -> TurnReply:
        """Wait for the end (a client that disconnects first cancels it: ApiError 499) -> the split reply."""
        (result,) = await self.job.collect(request)
        if self._turn is not None:
            result = self._turn.finish(result, self.prepared.text)
        self.reply = self._reply(result, result.text or "", result.reasoning, result.tool_calls or [])
        return self.reply

    async def deltas(self) -> AsyncIterator[Delta]:
        """The reply's deltas as they are generated (content only, for a plain turn), then ``self.reply``.
        An engine failure or a shutdown raises ApiError; closing the iterator early cancels the job."""
        out = self._turn.output(self.prepared.text) if self._turn is not None else None
        try:
            async for _, event in self.job.events():
                if event.text:
                    for d in out.feed(event.text) if out is not None else [Delta("content", event.text)]:
                        self._deltas.append(d)
                        yield d
                if event.last:
                    result = self.job.outcome(event)
                    for d in out.finish() if out is not None else []:
                        self._deltas.append(d)
                        yield d
                    content, reasoning, calls = assemble(self._deltas)
                    self.reply = self._reply(result, content or "", reasoning, calls if self._tools else [])
        finally:
            self.job.cancel()

    @property
    def _tools(self) -> bool:
        return self._turn is not None and self._turn.tools is not None

    def _reply(self, result: Any, content: str, reasoning: str | None, calls: list[dict]) -> TurnReply:
        reason = call_finish(result.finish_reason, calls)
        tokens = self.engine.llm.tokenizer.encode(reasoning, add_special_tokens=False).ids if reasoning else []
        return TurnReply(content, reasoning, calls, reason, len(self.prepared.ids), len(result.token_ids),
                         int(getattr(result.metrics, "cached_tokens", 0) or 0), min(len(tokens), len(result.token_ids)),
                         result.stop_sequence)
