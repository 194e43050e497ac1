"""One HTTP request's generations: prompts -> prepared requests (``LLM.prepare``) -> validated Sequences ->
engine requests -> an asyncio stream.

``encode_prompts`` / ``encode_chat_turn`` and ``prepare`` run in a worker thread (tokenizing and the chat template take milliseconds, which
the event loop must not spend); ``Job`` submits every choice to the engine at once (all or
none) and turns the engine thread's events into ``(choice index, Event)`` on an asyncio queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence as Seq, Union

from decodert.errors import Busy, DecodertError, MissingDependencyError, RequestError
from decodert.runtime.decoding.generate import GenerationResult, Sequence
from decodert.runtime.decoding.sampling import SamplingParams
from decodert.runtime.engine.request import CANCELLED, Prepared
from decodert.runtime.engine.thread import EngineClosed, EngineThread, Event, Handle, QueueFull
from decodert.serve.api_error import ApiError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default; chat defaults to the rest of the context
SHUTDOWN = "the server is shutting down"


@dataclass
class Choice:
    seq: Sequence
    prompt_index: int  # which prompt of the request (usage counts each prompt once)


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")


def sampling(engine: EngineThread, req, max_new_tokens: int, seed: int | None) -> SamplingParams:
    """SamplingParams of one choice: the fields the request set, over the model's sampling defaults
    (manifest.sampling, as ``LLM.generate``; greedy when the model has none)."""
    given = {name: getattr(req, name) for name in _SAMPLING_FIELDS
             if name in req.model_fields_set and getattr(req, name) is not None}
    given.update(req.sampling_extras())  # logit_bias, logprobs
    try:
        return engine.llm.params(max_new_tokens=max_new_tokens, seed=seed, stop=req.stops, **given)
    except DecodertError as e:
        raise ApiError(400, str(e), param=str(e).split(" ", 1)[0]) from None


def prepare(engine: EngineThread, prompts: Seq[Prepared], req, limit: int | None, default: int | None,
            speculative: Any = None, adapter: str | None = None) -> list[Choice]:
    """Sequences for ``req.n`` choices of every prepared prompt; ApiError 400 when one cannot run.

    ``limit`` is the requested max_tokens (None: ``default``, or the rest of the context when
    that is None too); prompt + limit must fit the context (the artifact's max_seq).
    ``speculative``: the server's default (a method or a SpeculativeConfig: --draft-len), used unless the
    request sets its own method ("off": none), which keeps the server's draft length.
    ``adapter``: the LoRA adapter the request's model names (None: the base model).
    """
    max_seq = engine.llm.max_seq
    capacity = engine.slots + engine.max_queue
    if len(prompts) * req.n > capacity:  # a 429 would never clear: the client would retry forever
        raise ApiError(400, f"this request asks for {len(prompts) * req.n} generations (prompts x n), but the server "
                            f"takes at most {capacity} at a time ({engine.slots} slots + --max-queue {engine.max_queue})",
                       param="n")
    spec = req.speculative if req.speculative is not None else speculative
    spec = None if spec == "off" else spec
    if isinstance(spec, str) and hasattr(speculative, "method"):
        spec = dataclasses.replace(speculative, method=spec)
    try:
        engine.speculation(spec)
    except DecodertError as e:
        raise ApiError(400, str(e), param="speculative") from None
    constraint = prompts[0].constraint if prompts else None  # the same for every prompt (tools' included)
    if constraint is not None:
        try:
            engine.llm.guidance.guide(constraint)  # compiled once here (cached), so a bad schema is its own 400
        except MissingDependencyError as e:  # the server's installation is at fault, not the request
            raise ApiError(500, str(e), type="server_error", code="missing_dependency") from None
        except DecodertError as e:  # the tools' constraint is the tools' fault (prepared.turn.tools: runtime/chat/turn.py)
            turn = getattr(prompts[0], "turn", None)
            tools = turn is not None and getattr(turn, "tools", None) is not None
            raise ApiError(400, str(e), param="tools" if tools else "response_format") from None
    choices = []
    for p, base in enumerate(prompts):
        ids = base.ids
        room = max_seq - len(ids)
        if limit is not None and len(ids) + limit > max_seq or room < 1:
            asked = limit if limit is not None else 1
            raise ApiError(400, f"the context is {max_seq} tokens, but the prompt has {len(ids)} and max_tokens "
                                f"asks for {asked} more; shorten the prompt or lower max_tokens",
                           param="messages" if hasattr(req, "messages") else "prompt", code="context_length_exceeded")
        n_new = limit if limit is not None else min(room, default) if default is not None else room
        for j in range(req.n):
            seed = None if req.seed is None else req.seed + j
            prepared = dataclasses.replace(base, params=sampling(engine, req, n_new, seed), speculative=spec,
                                           adapter=adapter, what="prompt" if len(prompts) == 1 else f"prompt {p}")
            try:
                seq = engine.sequence(prepared)
            except DecodertError as e:
                raise ApiError(400, str(e), param="logit_bias" if str(e).startswith("logit_bias") else "prompt") from None
            choices.append(Choice(seq, p))
    return choices


def completion_choices(engine: EngineThread, req, speculative: Any, adapter: str | None = None) -> tuple[list[Prepared], list[Choice]]:
    """A completions request -> its prepared prompts and every choice's sequence, in one thread-pool hop."""
    prompts = encode_prompts(engine, req.prompts(), req)
    return prompts, prepare(engine, prompts, req, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, speculative, adapter)


def chat_choices(engine: EngineThread, req, speculative: Any, adapter: str | None = None) -> tuple[Prepared, list[Choice]]:
    """A chat request -> its prepared turn (tools, thinking) and every choice's sequence, in one thread-pool hop."""
    prepared = encode_chat_turn(engine, req)
    return prepared, prepare(engine, [prepared], req, req.limit, None, speculative, adapter)


def encode_prompts(engine: EngineThread, prompts: Seq[Union[str, list[int]]], req) -> list[Prepared]:
    """A completions request's prompts, prepared (sampling is set per choice by ``prepare``)."""
    llm = engine.llm
    try:
        return [llm.prepare(p, chat=False, constraint=req.constraint) for p in prompts]
    except DecodertError as e:
        raise ApiError(400, str(e), param="prompt") from None


class Job:
    """The engine requests of one HTTP request; ``events()`` yields ``(choice index, Event)`` until all ended."""

    def __init__(self, engine: EngineThread, choices: list[Choice], received: float, observe=None) -> None:
        self.choices = choices
        self.received = received  # time.perf_counter() when the request arrived
        self._observe = observe  # observe(result, ttft_s) on the engine thread for every finished choice
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._handles: list[Handle] = []
        self._finished: dict[int, GenerationResult] = {}  # choice -> its result, as the engine thread hands them over
        try:
            for j, choice in enumerate(choices):
                self._handles.append(engine.submit(choice.seq, self._sink(loop, j)))
        except QueueFull as e:
            self.cancel()
            raise ApiError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except EngineClosed as e:
            self.cancel()
            raise ApiError(503, str(e), type="server_error", code="unavailable") from None
        self._open = len(choices)

    def _sink(self, loop: asyncio.AbstractEventLoop, j: int):
        def put(event: Event) -> None:  # engine thread: hand over to the event loop, never block
            if event.result is not None:
                self._finished[j] = event.result
                if self._observe is not None:  # counted even if nobody reads it
                    self._observe(event.result, self.ttft(j))
            loop.call_soon_threadsafe(self._queue.put_nowait, (j, event))
        return put

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        while self._open:
            j, event = await self._queue.get()
            if event.last:
                self._open -= 1
            yield j, event

    def outcome(self, event: Event) -> GenerationResult:
        """A choice's result from its last event; an engine error or a shutdown cancel becomes an ApiError
        (and cancels the other choices)."""
        if event.error is not None:
            self.cancel()
            raise ApiError(500, event.error, type="server_error", code="generation_failed")
        result = event.result
        if result.finish_reason == CANCELLED:
            self.cancel()
            raise ApiError(503, SHUTDOWN, type="server_error", code="unavailable")
        return result

    async def collect(self, request: Any) -> list[GenerationResult]:
        """Every choice's result; a client that goes away first (``request``: the Starlette request) cancels
        them (ApiError 499, never sent)."""
        results: list = [None] * len(self.choices)

        async def gather() -> None:
            async for j, event in self.events():
                if event.last:
                    results[j] = self.outcome(event)

        gathering = asyncio.ensure_future(gather())
        watching = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({gathering, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not gathering.done():
                self.cancel()
                gathering.cancel()
        if not gathering.done() or gathering.cancelled():
            raise ApiError(499, "the client closed the connection")
        gathering.result()
        return results

    def cancel(self) -> None:
        """Cancel every choice still running (a disconnect, a failed sibling); finished ones are left alone."""
        for handle in self._handles:
            handle.cancel()

    def tokens(self) -> tuple[int, int]:
        """(prompt tokens, each prompt once; tokens generated by the choices finished so far), for the request log."""
        prompts = {c.prompt_index: len(c.seq.prompt) for c in self.choices}
        return sum(prompts.values()), sum(len(r.token_ids) for r in list(self._finished.values()))

    def ttft(self, j: int) -> float | None:
        """Request received -> first token of choice ``j`` (queueing included), or None."""
        timer = self.choices[j].seq.timer
        return timer.t_first - self.received if timer.tokens else None


async def _disconnected(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def now() -> float:
    return time.perf_counter()


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass



def encode_chat_turn(engine: EngineThread, req) -> Prepared:
    """A chat request, prepared: its turn (tools, thinking: runtime/chat/turn.py), rendered prompt and ids, the
    tools' constraint merged with response_format's. ApiError 400 on bad messages or tools."""
    try:  # image_url parts are decoded under the limits
        return engine.llm.prepare(req.message_dicts(), chat=True, constraint=req.constraint, **req.chat_options())
    except Busy as e:  # every image-fetch place is taken (runtime/vision/fetch.py)
        raise ApiError(503, str(e), type="server_error", code="unavailable", headers={"Retry-After": "1"}) from None
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param or "messages") from None
    except DecodertError as e:
        raise ApiError(400, str(e), param="messages") from None
