"""The OpenAI-compatible ASGI app over one EngineThread (FastAPI routes, SSE streams, a guard middleware).

    app = build_app(engine, ServeConfig(model_name="smollm2", api_key="..."))

Handlers never run a model step: they validate, tokenize (in a worker thread), submit every
choice to the engine and await its events. A client that disconnects cancels its requests, which
leave their slots before the engine's next step. The app's lifespan starts the engine and, at
shutdown (after uvicorn has drained the connections), stops it, cancelling what is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from decodert.errors import first_line
from decodert.runtime.engine.thread import EngineThread
from decodert.serve.protocols import anthropic, transcriptions
from decodert.serve.protocols.embeddings import EmbeddingRequest, Embeddings
from decodert.serve.guard import Guard
from decodert.serve.jobs import Job, chat_choices, completion_choices
from decodert.serve.protocols.logprobs import logprob_format
from decodert.serve.metrics import CONTENT_TYPE, ServerMetrics
from decodert.serve.models import card_for, check_model, model_list
from decodert.serve.protocols.responses_api import add_routes as add_responses_routes
from decodert.serve.api_error import ApiError
from decodert.serve.protocols.requests import ChatCompletionRequest, CompletionRequest, parse
from decodert.serve.protocols.replies import Reply, usage


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    api_key: str | None = None  # required on /v1/* when set: "Authorization: Bearer KEY" or "x-api-key: KEY"
    max_body_bytes: int = 4 << 20
    drain_s: float = 30.0  # SIGTERM: seconds streams may still run before they are cancelled
    speculative: Any = None  # speculative decoding for requests that do not choose ("ngram" | "draft" | a SpeculativeConfig)
    client_timeout_s: float = 30.0  # a body must arrive, and each stream write be taken, within this (slow clients)
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback and the bound address ("*": any)
    responses_store: int = 256  # /v1/responses kept for previous_response_id (store: true), LRU; 0: none
    aliases: tuple[str, ...] = ()  # more names of the base model (serve/models.py), listed and accepted
    accept_any_model: bool = False  # any model name means the base model
    created: int = 0  # /v1/models "created": when the artifact was exported (serve/models.py created_time)
    allowed_origins: tuple[str, ...] = ()  # CORS: origins granted cross-origin access (serve/guard.py; "*": any)


def build_app(engine: EngineThread, config: ServeConfig) -> FastAPI:
    metrics = ServerMetrics(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await run_in_threadpool(engine.stop, 0.0)

    app = FastAPI(title="decodert", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.config, app.state.metrics = engine, config, metrics
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes, metrics=metrics,
                       body_timeout_s=config.client_timeout_s, allowed_hosts=config.allowed_hosts,
                       allowed_origins=config.allowed_origins)

    _add_error_handlers(app)
    anthropic.add_routes(app, engine, config, metrics)  # /v1/messages, /v1/messages/count_tokens
    add_responses_routes(app, engine, config, metrics, lambda name: check_model(name, config, engine))  # /v1/responses
    transcriptions.add_routes(app, engine, config, metrics, lambda name: check_model(name, config, engine))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "pid": os.getpid(), "slots": engine.slots,
                             "slots_in_use": engine.llm.slots_in_use, "queued": engine.queued},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_list(engine, config)}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict[str, Any]:
        return card_for(name, engine, config)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = time.perf_counter()
        req = parse(CompletionRequest, await request.body())
        adapter = check_model(req.model, config, engine)
        prompts, choices = await run_in_threadpool(completion_choices, engine, req, config.speculative, adapter)
        return await _respond(request, Job(engine, choices, received, metrics.observe), req,
                              Reply("completion", req.model, logprob_format(req, engine.llm.tokenizer, False)),
                              [len(p.ids) for p in prompts], config)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.perf_counter()
        req = parse(ChatCompletionRequest, await request.body())
        adapter = check_model(req.model, config, engine)
        prepared, choices = await run_in_threadpool(chat_choices, engine, req, config.speculative, adapter)
        return await _respond(request, Job(engine, choices, received, metrics.observe), req,
                              Reply("chat", req.model, logprob_format(req, engine.llm.tokenizer, True), prepared.turn,
                                    prepared.text), [len(prepared.ids)], config)

    embeddings = Embeddings(engine.llm)

    @app.post("/v1/embeddings")
    async def embed(request: Request) -> JSONResponse:  # serve/protocols/embeddings.py: a worker thread, beside the engine
        req = parse(EmbeddingRequest, await request.body())
        if check_model(req.model, config, engine) is not None:
            raise ApiError(400, "embeddings come from the base model; LoRA adapters do not apply to them", param="model")
        return JSONResponse(await embeddings.respond(req))

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (Anthropic's on its routes): ApiError as it says, 404/405, and any other
    exception as a one-line 500."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        body = anthropic.error_body(e.status, e.message) if anthropic.speaks(request.url.path) else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405 in OpenAI's shape
        what = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return await api_error(request, ApiError(e.status_code, what, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return await api_error(request, ApiError(500, f"internal error: {type(e).__name__}: {first_line(e)}",
                                                 type="server_error"))


async def _respond(request: Request, job: Job, req, reply: Reply, prompt_lengths: list[int],
                   config: ServeConfig) -> Response:
    request.state.job = job  # the request log's token counts (serve/guard.py)
    if req.stream:
        # a reader that takes no bytes for client_timeout_s is dropped (its generator closes: the job is cancelled)
        return EventSourceResponse(_stream(job, req, reply, prompt_lengths), sep="\n", ping=15,
                                   shutdown_grace_period=config.drain_s, send_timeout=config.client_timeout_s)
    results = await job.collect(request)
    return JSONResponse(reply.body(results, usage(prompt_lengths, results)))


async def _stream(job: Job, req, reply: Reply, prompt_lengths: list[int]) -> AsyncIterator[str]:
    """SSE data: chunks per choice as tokens arrive, finish reasons, usage if asked, then [DONE]."""
    results: list = [None] * len(job.choices)
    want_usage = req.include_usage
    try:
        if reply.chat:
            for j in range(len(job.choices)):
                yield json.dumps(reply.chunk(j, role=True, usage=want_usage))
        async for j, event in job.events():
            if event.text or event.logprobs:  # a last token's logprobs may come without text
                for chunk in reply.text_chunks(j, event.text, want_usage, event.logprobs):  # content, reasoning, tool calls
                    yield json.dumps(chunk)
            if event.last:
                results[j] = job.outcome(event)
                for chunk in reply.end_chunks(j, results[j].finish_reason, want_usage):
                    yield json.dumps(chunk)
        if want_usage:
            yield json.dumps(reply.usage_chunk(usage(prompt_lengths, results)))
        yield "[DONE]"
    except ApiError as e:
        yield json.dumps(e.body())
        yield "[DONE]"
    finally:  # done, failed, or cancelled by a disconnect / the shutdown grace period
        job.cancel()
