"""The Anthropic Messages API: ``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``.

A Messages request is translated into a chat-completions request (serve/protocols/requests.py) and runs on the chat
path (serve/protocols/chat_run.py ``ChatRun``, as /v1/responses): the same template, tools, constraints and reasoning split as
``/v1/chat/completions`` (runtime/chat/). The translation:

    Messages                                        chat completions
    system (a string or text blocks)            ->  a system message
    user text / image blocks                    ->  a user message (an image as a data: URL; a url source
                                                    only under --allow-image-urls)
    user input_audio blocks (a decodert          ->  input_audio parts (Anthropic has no audio block; the
      extension)                                     OpenAI part's shape, {"data": base64, "format": "wav"})
    user tool_result blocks                     ->  one "tool" message each, before the user's other blocks
                                                    (content: a string or text blocks; is_error: "Error: ...")
    assistant text / tool_use blocks            ->  an assistant message with tool_calls
    assistant thinking / redacted_thinking      ->  dropped (templates drop earlier turns' reasoning)
    tools [{name, description, input_schema}]   ->  function tools
    tool_choice auto | any | tool | none        ->  auto | required | the named function | none
      disable_parallel_tool_use                 ->  parallel_tool_calls: false
    thinking enabled | disabled | adaptive      ->  enable_thinking true | false | the template's default
      (absent: disabled, as Anthropic's API)
    output_config.format json_schema            ->  response_format json_schema (strict)
    max_tokens (required), stop_sequences, temperature (0-1), top_p, top_k -> the same sampling fields
      (unset: the model's defaults, as on the OpenAI routes; ``seed``, a decodert extension, as there)

and back: the reasoning as a thinking block, the content as a text block, each call as a tool_use block
(its input the call's arguments); ``stop_reason`` tool_use when calls were made, max_tokens on length,
stop_sequence (with ``stop_sequence`` set) when a stop string ended the reply, end_turn otherwise;
``usage``: input_tokens (the prompt's tokens not read from the prefix cache), cache_read_input_tokens
(those read from it), output_tokens. count_tokens renders the same prompt: its input_tokens is the
prompt's length (input_tokens + cache_read_input_tokens of the reply).

A stream is Anthropic's event sequence: message_start; per block content_block_start, content_block_delta
(text_delta | thinking_delta | input_json_delta)..., content_block_stop; message_delta (stop_reason,
stop_sequence, usage); message_stop. A failure after message_start is an ``error`` event.

Errors on these routes are in Anthropic's shape (``error_body``; the guard's and the app's handlers use it
for every path ``speaks`` names). What would change the meaning and is not implemented (server tools,
document and search_result blocks, citations, container, mcp_servers, context_management, a final
assistant message to continue) is a one-line 400. Accepted and without effect: cache_control, metadata,
service_tier, output_config.effort, thinking.budget_tokens (checked, < max_tokens; the reply's thinking
is bounded by max_tokens only), the anthropic-version / anthropic-beta headers.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from decodert.runtime.chat.output import Delta
from decodert.serve.protocols.chat_run import ChatRun, TurnReply
from decodert.serve.jobs import encode_chat_turn
from decodert.serve.models import check_model
from decodert.serve.api_error import ApiError
from decodert.serve.protocols.requests import ChatCompletionRequest, parse

PATHS = ("/v1/messages",)  # and below: the routes whose errors are in Anthropic's shape
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
REFUSED = ("container", "mcp_servers", "context_management")  # top-level fields this server does not implement
TOOL_KEYS = ("name", "description", "input_schema", "type", "cache_control", "strict", "eager_input_streaming")
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def speaks(path: str) -> bool:
    """Whether errors on ``path`` are in Anthropic's shape."""
    return any(path == p or path.startswith(p + "/") for p in PATHS)


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, the type by status (4xx: invalid_request_error,
    5xx: api_error, unless named in ERROR_TYPES)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _bad(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}" if where else message, param=where or None)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class InputMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: Any  # a string or a list of content blocks (checked by ``_message``)


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[InputMessage]
    system: Any = None  # a string or a list of text blocks
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    max_tokens: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None

    def check(self) -> None:
        refused = [k for k in REFUSED if k in (self.model_extra or {})]
        if refused:
            raise _bad(refused[0], "is not supported by this server")
        if not self.messages:
            raise _bad("messages", "must be a non-empty list")
        if self.messages[-1].role == "assistant":
            raise _bad("messages", "a final assistant message (a prefill to continue) is not supported; end with "
                                   "a user message")

    def chat(self, allow_urls: bool) -> ChatCompletionRequest:
        """The chat-completions request this one runs as (checked: ApiError 400)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._messages(allow_urls)}
        fields.update(_tools(self.tools, self.tool_choice))
        thinking = _thinking(self.thinking, self.max_tokens)
        if thinking is not None:
            fields["enable_thinking"] = thinking
        if thinking and fields.get("tool_choice") not in (None, "auto", "none"):
            raise _bad("thinking", "thinking cannot be enabled when tool_choice forces tool use (any or tool)")
        fmt = _output_format(self.output_config)
        if fmt is not None:
            fields["response_format"] = fmt
        fields.update(self._sampling())
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            err = e.errors()[0]
            raise _bad(".".join(str(p) for p in err["loc"]), err["msg"]) from None
        chat.check()
        return chat

    def _sampling(self) -> dict[str, Any]:
        return {}

    def _messages(self, allow_urls: bool) -> list[dict[str, Any]]:
        out = [{"role": "system", "content": _system(self.system)}] if self.system not in (None, "", []) else []
        for i, m in enumerate(self.messages):
            out += _message(i, m, allow_urls)
        return out


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None  # a decodert extension (as on the OpenAI routes): sampling repeats for a seed

    def check(self) -> None:
        super().check()
        if self.max_tokens < 1:
            raise _bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise _bad("temperature", f"must be between 0 and 1, got {self.temperature!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"must be > 0 and <= 1, got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 1:
            raise _bad("top_k", f"must be >= 1, got {self.top_k}")
        if any(not s for s in self.stop_sequences or ()):
            raise _bad("stop_sequences", "must be non-empty strings")

    def _sampling(self) -> dict[str, Any]:
        given = {"max_tokens": self.max_tokens, "stream": self.stream, "stop": self.stop_sequences}
        given.update({k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "seed")})
        return {k: v for k, v in given.items() if v is not None}


# -- request translation ----------------------------------------------------------------------------------------
def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(_text_block(f"system[{k}]", b) for k, b in enumerate(system))
    raise _bad("system", "must be a string or a list of text blocks")


def _text_block(where: str, block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise _bad(where, "must be a text block {'type': 'text', 'text': ...}")
    if block.get("citations"):
        raise _bad(f"{where}.citations", "citations are not supported by this server")
    return block["text"]


def _message(i: int, m: InputMessage, allow_urls: bool) -> list[dict[str, Any]]:
    """One Messages message -> its chat messages (a user message with tool results: the "tool" messages first)."""
    where = f"messages[{i}]"
    if m.role not in ("user", "assistant"):
        raise _bad(f"{where}.role", f"must be 'user' or 'assistant', got {m.role!r:.40}")
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if not isinstance(m.content, list):
        raise _bad(f"{where}.content", "must be a string or a list of content blocks")
    tools: list[dict[str, Any]] = []  # user: tool results; assistant: calls
    parts: list[dict[str, Any]] = []  # text, image and audio parts
    for k, block in enumerate(m.content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        allowed = ("text", "image", "input_audio", "tool_result") if m.role == "user" else ("text", "tool_use", "thinking",
                                                                               "redacted_thinking")
        if kind not in allowed:
            raise _bad(at, f"block type {kind!r:.40} is not supported in a {m.role} message ({', '.join(allowed)})")
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(at, block)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(at, block, allow_urls)}})
        elif kind == "input_audio":  # no Anthropic audio block exists: OpenAI's input_audio part, as in chat
            parts.append({"type": "input_audio", "input_audio": block.get("input_audio")})
        elif kind == "tool_result":
            tools.append(_tool_result(at, block))
        elif kind == "tool_use":
            tools.append(_tool_use(at, block))
    if m.role == "assistant":
        text = "".join(p["text"] for p in parts)
        return [{"role": "assistant", "content": text, **({"tool_calls": tools} if tools else {})}]
    if not parts:
        return tools
    content: Any = parts if any(p["type"] != "text" for p in parts) else "".join(p["text"] for p in parts)
    return [*tools, {"role": "user", "content": content}]


def _image_url(where: str, block: dict, allow_urls: bool) -> str:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in IMAGE_TYPES or not isinstance(data, str):
            raise _bad(f"{where}.source", f"a base64 source needs media_type ({', '.join(IMAGE_TYPES)}) and data")
        return f"data:{media};base64,{data}"
    if kind == "url":
        if not allow_urls:
            raise _bad(f"{where}.source", "url image sources are refused by this server (start it with "
                                          "--allow-image-urls); send the image as a base64 source")
        if not isinstance(source.get("url"), str):
            raise _bad(f"{where}.source.url", "must be a string")
        return source["url"]
    raise _bad(f"{where}.source", f"image source type {kind!r:.40} is not supported (base64, url)")


def _tool_result(where: str, block: dict) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id", "must be a non-empty string")
    if isinstance(content, list):
        content = "".join(_text_block(f"{where}.content[{k}]", b) for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise _bad(f"{where}.content", "must be a string or a list of text blocks")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_use(where: str, block: dict) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _bad(where, "a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{where}.input", "must be a JSON object")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """``tools`` / ``tool_choice`` -> the chat fields tools, tool_choice, parallel_tool_calls."""
    out: dict[str, Any] = {}
    if tools is not None:
        converted = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if tool.get("type") not in (None, "custom"):
                raise _bad(where, f"server tool type {tool['type']!r:.60} is not supported; only custom tools "
                                  "{'name', 'description', 'input_schema'}")
            unknown = [k for k in tool if k not in TOOL_KEYS]
            if unknown:
                raise _bad(f"{where}.{unknown[0]}", "is not supported by this server")
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
                raise _bad(where, "a tool needs a string name and an input_schema object")
            fn = {"name": tool["name"], "parameters": tool["input_schema"]}
            if isinstance(tool.get("description"), str):
                fn["description"] = tool["description"]
            converted.append({"type": "function", "function": fn})
        out["tools"] = converted
    if choice is not None:
        kind = choice.get("type")
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise _bad("tool_choice.name", "must name a tool")
            mapped = {"type": "function", "function": {"name": choice["name"]}}
        if mapped is None:
            raise _bad("tool_choice.type", f"must be auto, any, tool or none, got {kind!r:.40}")
        out["tool_choice"] = mapped
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise _bad("tool_choice.disable_parallel_tool_use", "must be true or false")
            out["parallel_tool_calls"] = not parallel
    return out


def _thinking(thinking: Any, max_tokens: int | None) -> bool | None:
    """enable_thinking for the template: True, False, or None (adaptive: the template's default)."""
    if thinking is None:
        return False
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        if thinking.get("display") == "omitted":
            raise _bad("thinking.display", "'omitted' is not supported (the thinking is returned as it is)")
        return None
    if kind != "enabled":
        raise _bad("thinking.type", f"must be enabled, disabled or adaptive, got {kind!r:.40}")
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise _bad("thinking.budget_tokens", f"must be an integer >= 1, got {budget!r:.40}")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
    return True


def _output_format(config: Any) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


# -- replies ----------------------------------------------------------------------------------------------------
def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use input; a call cut by max_tokens keeps {} (its stop_reason says so)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop_reason(reply: TurnReply) -> str:
    if reply.finish_reason == "length":
        return "max_tokens"
    if reply.tool_calls:
        return "tool_use"
    return "stop_sequence" if reply.stop_sequence is not None else "end_turn"


def _usage(reply: TurnReply) -> dict[str, Any]:
    return {"input_tokens": reply.input_tokens - reply.cached_tokens, "output_tokens": reply.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": reply.cached_tokens}


class MessageReply:
    """One reply over a ChatRun (serve/protocols/chat_run.py: the chat path splits the text): its id and model, whole or
    as stream events."""

    def __init__(self, model: str, run: ChatRun) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.run = run

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    async def body(self, request: Request) -> dict[str, Any]:
        reply = await self.run.whole(request)
        blocks: list[dict[str, Any]] = []
        if reply.reasoning:
            blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.content:
            blocks.append({"type": "text", "text": reply.content})
        for call in reply.tool_calls:
            blocks.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                           "input": _input(call["function"]["arguments"])})
        return {**self._head(), "content": blocks, "stop_reason": _stop_reason(reply),
                "stop_sequence": reply.stop_sequence, "usage": _usage(reply)}

    async def events(self) -> AsyncIterator[dict[str, str]]:
        """The SSE events of a streamed reply (``{"event", "data"}``); the run is cancelled when it ends."""
        blocks = _Blocks()
        start = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(self.run.prepared.ids), "output_tokens": 0}}
        deltas = self.run.deltas()
        try:
            yield _event("message_start", message=start)
            async for d in deltas:
                for e in blocks.feed([d]):
                    yield e
            for e in blocks.close():
                yield e
            reply = self.run.reply
            delta = {"stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_sequence}
            yield _event("message_delta", delta=delta, usage=_usage(reply))
            yield _event("message_stop")
        except ApiError as e:
            yield {"event": "error", "data": json.dumps(error_body(e.status, e.message))}
        finally:  # done, failed, or cancelled by a disconnect / the shutdown grace period
            await deltas.aclose()


def _event(kind: str, **fields: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}


class _Blocks:
    """Split deltas (runtime/chat/output.py) -> content block events: a block opens when the kind of text
    changes or a call begins, and closes when the next one opens (or at the end)."""

    def __init__(self) -> None:
        self.index = -1  # the open block (-1: none yet)
        self.kind: str | None = None  # its delta kind: "content" | "reasoning" | "tool"; None: closed
        self.calls: dict[int, int] = {}  # call index -> its block
        self.called = False

    def feed(self, deltas: list[Delta]) -> list[dict[str, str]]:
        events: list[dict[str, str]] = []
        for d in deltas:
            if d.kind == "tool":
                if d.id is not None:
                    events += self._open("tool", {"type": "tool_use", "id": _tool_id(d.id), "name": d.name,
                                                  "input": {}})
                    self.calls[d.index], self.called = self.index, True
                if d.text:
                    events.append(_event("content_block_delta", index=self.calls[d.index],
                                         delta={"type": "input_json_delta", "partial_json": d.text}))
            elif d.text:
                thinking = d.kind == "reasoning"
                if self.kind != d.kind:
                    events += self._open(d.kind, {"type": "thinking", "thinking": "", "signature": ""} if thinking
                                         else {"type": "text", "text": ""})
                delta = {"type": "thinking_delta", "thinking": d.text} if thinking else {"type": "text_delta",
                                                                                         "text": d.text}
                events.append(_event("content_block_delta", index=self.index, delta=delta))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, str]]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [_event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[dict[str, str]]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", index=self.index)]


# -- routes ------------------------------------------------------------------------------------------------------
def add_routes(app: FastAPI, engine: Any, config: Any, metrics: Any) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` on ``app`` (serve/app.py build_app)."""

    def allow_urls() -> bool:
        return engine.llm.fetch_image is not None

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = parse(MessagesRequest, await request.body())
        adapter = check_model(req.model, config, engine)
        chat = req.chat(allow_urls())
        run = await ChatRun.start(engine, chat, config.speculative, adapter, metrics.observe)
        request.state.job = run.job  # the request log's token counts (serve/guard.py)
        reply = MessageReply(req.model, run)
        if req.stream:
            return EventSourceResponse(reply.events(), sep="\n", ping=15, shutdown_grace_period=config.drain_s,
                                       send_timeout=config.client_timeout_s)
        return JSONResponse(await reply.body(request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        req = parse(CountTokensRequest, await request.body())
        check_model(req.model, config, engine)
        prepared = await run_in_threadpool(encode_chat_turn, engine, req.chat(allow_urls()))
        return JSONResponse({"input_tokens": len(prepared.ids)})
