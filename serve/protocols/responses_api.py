"""``POST /v1/responses`` (OpenAI's Responses API) as a thin adapter over a chat turn (serve/protocols/chat_run.py).

    add_routes(app, engine, config, metrics, check_model)   # POST /v1/responses, GET / DELETE /v1/responses/{id}

A request becomes a ``ChatCompletionRequest``: ``instructions`` the system message; ``input`` items the messages
(``message`` with input_text / input_image / input_audio / output_text parts; consecutive ``function_call`` items one assistant
message's tool_calls; ``function_call_output`` a role "tool" message; ``reasoning`` items passed back are accepted
and not rendered, as thinking templates drop earlier turns' reasoning); function ``tools`` the chat tools;
``tool_choice`` / ``parallel_tool_calls`` as they are; ``text.format`` the response_format; ``max_output_tokens``
max_tokens; ``reasoning.effort`` "none" turns thinking off (other efforts are accepted and change nothing). The
reply's split (content, reasoning, calls) becomes output items: a ``reasoning`` item (its text as reasoning_text
content, no summary), a ``message`` with one output_text part, one ``function_call`` per call.

Storing: ``store`` defaults to false here (OpenAI's default is true): a response is kept only when the request says
``store: true``, in a bounded in-memory LRU (``ServeConfig.responses_store`` responses; ``--responses-store``, 0 =
none). ``previous_response_id`` continues a stored response: its whole history (inputs and outputs; not its
instructions, as OpenAI) comes before the new input, so the prompt is the one sending the history would render,
and its K/V comes from the prefix cache. An unknown or evicted id is a 404.

Fields that would change the meaning of the request and that this server cannot honour (``background``,
``conversation``, ``prompt``, ``context_management``, ``truncation: "auto"``, ``include`` values, ``top_logprobs``,
built-in tools, text verbosity other than medium) are a one-line 400, never ignored; metadata-like fields
(``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``, ``stream_options``) are
accepted and have no effect.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from sse_starlette.sse import EventSourceResponse

from decodert.runtime.chat.output import Delta
from decodert.serve.protocols.chat_run import ChatRun, TurnReply
from decodert.serve.api_error import ApiError
from decodert.serve.protocols.requests import ChatCompletionRequest, parse
from decodert.serve.protocols.response_store import ResponseStore, Stored

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_REFUSED = (("background", "runs every response in the foreground"), ("conversation", "keeps no conversations"),
            ("prompt", "has no stored prompts"), ("context_management", "does not compact the context"))
MAX_METADATA = 16  # key-value pairs, as OpenAI


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``, validated strictly (types, ranges, what this server cannot do)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: Union[str, list[dict[str, Any]], None] = None
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: Optional[dict[str, Any]] = None  # {"effort": ..., "summary": ...}
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None  # decodert extension, as chat completions' seed
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None  # include_obfuscation: nothing to obfuscate, accepted
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    top_logprobs: Optional[int] = None
    user: Optional[str] = None
    # refused when set (_REFUSED); declared so that they are seen, not dropped with the unknown fields
    background: Optional[bool] = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: Optional[dict[str, Any]] = None
    context_management: Optional[list[Any]] = None

    def check(self) -> None:
        for name, why in _REFUSED:
            if getattr(self, name) not in (None, False):
                raise ApiError(400, f"{name} is not supported: this server {why}", param=name)
        if self.truncation not in (None, "disabled"):
            raise ApiError(400, f"truncation {self.truncation!r} is not supported (only 'disabled': a prompt longer than "
                                "the context is a 400)", param="truncation")
        if self.include:
            raise ApiError(400, f"include {self.include[0]!r} is not supported (this server has nothing to include)",
                           param="include")
        if self.top_logprobs:
            raise ApiError(400, "top_logprobs is not supported on /v1/responses (use /v1/chat/completions' logprobs)",
                           param="top_logprobs")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ApiError(400, f"max_output_tokens must be >= 1, got {self.max_output_tokens}", param="max_output_tokens")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA:
            raise ApiError(400, f"metadata has {len(self.metadata)} pairs; at most {MAX_METADATA}", param="metadata")
        if self.input is None and self.previous_response_id is None:
            raise ApiError(400, "input is required (a string or a list of items)", param="input")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ApiError(400, "input must not be an empty list", param="input")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in EFFORTS:
            raise ApiError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r:.40}",
                           param="reasoning.effort")
        verbosity = (self.text or {}).get("verbosity")
        if verbosity not in (None, "medium"):
            raise ApiError(400, f"text.verbosity {verbosity!r:.20} is not supported (only 'medium')", param="text.verbosity")

    @property
    def items(self) -> list[dict[str, Any]]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input or [])

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat turn to run: ``history`` (a stored response's items) + this input, with tools and options."""
        messages = chat_messages(history + self.items)
        if self.instructions:
            messages = [{"role": "system", "content": self.instructions}, *messages]
        if not messages:
            raise ApiError(400, "input has no messages to answer", param="input")
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = chat_tools(self.tools)
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        fmt = response_format((self.text or {}).get("format"))
        for name, value in (("parallel_tool_calls", self.parallel_tool_calls), ("max_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p), ("seed", self.seed),
                            ("response_format", fmt)):
            if value is not None:
                body[name] = value
        if (self.reasoning or {}).get("effort") == "none":
            body["enable_thinking"] = False
        try:
            return parse(ChatCompletionRequest, json.dumps(body).encode())
        except ApiError as e:
            raise responses_error(e) from None


_PARAMS = (("messages", "input"), ("response_format", "text.format"), ("max_tokens", "max_output_tokens"))


def responses_error(e: ApiError) -> ApiError:
    """An error of the chat path with its ``param`` named as the Responses request names it (messages -> input,
    response_format -> text.format); the message is the chat path's (its "chat message i" counts the translated
    messages: the instructions first, a function_call joined to the assistant message before it)."""
    param = e.param
    for chat, ours in _PARAMS:
        if param is not None and (param == chat or param.startswith(chat + "[") or param.startswith(chat + ".")):
            param = ours + param[len(chat):]
            break
    return ApiError(e.status, e.message, e.type, param, e.code, e.headers)


# ---- request translation: items -> chat messages, tools -> chat tools -------------------------------------------
def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (ApiError 400 naming ``input[i]`` on an item this server cannot read)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object (an item)", param=f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"input[{i}].role must be user, assistant, system or developer, got {role!r:.40}",
                               param=f"input[{i}].role")
            out.append({"role": "system" if role == "developer" else role, "content": _content(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(i, item, "call_id"), "type": "function",
                    "function": {"name": _string(i, item, "name"), "arguments": _string(i, item, "arguments", True)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls after the message that announced them
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(i, item, "call_id"),
                        "content": _output_text(i, item.get("output"))})
        elif kind == "reasoning":
            continue  # earlier turns' thinking: not rendered (the templates that think drop it too)
        elif kind == "item_reference":
            raise ApiError(400, f"input[{i}]: item_reference is not supported; send the item itself, or continue a "
                                "stored response with previous_response_id", param=f"input[{i}]")
        else:
            raise ApiError(400, f"input[{i}]: item type {kind!r:.40} is not supported (message, function_call, "
                                "function_call_output, reasoning)", param=f"input[{i}].type")
    return out


def _string(i: int, item: dict, key: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise ApiError(400, f"input[{i}] ({item.get('type')}) needs a string {key!r}", param=f"input[{i}].{key}")
    return value


def _content(i: int, content: Any) -> Union[str, list[dict[str, Any]]]:
    """A message's content: a string; text parts joined; with images or audio, chat parts (text / image_url /
    input_audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"input[{i}].content must be a string or a list of parts", param=f"input[{i}].content")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        where = f"input[{i}].content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise ApiError(400, f"{where} ({kind}) needs a string text", param=where)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ApiError(400, f"{where}: input_image needs an image_url (a data: URL; file_id is not supported)",
                               param=where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "input_audio":  # the same {"data": base64, "format": "wav"} as chat's part, decoded in runtime/audio
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
        else:
            raise ApiError(400, f"{where}: part type {kind!r:.40} is not supported (input_text, input_image, "
                                "input_audio, output_text)", param=where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _output_text(i: int, output: Any) -> str:
    """A function_call_output's output: a string, or input_text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise ApiError(400, f"input[{i}].output must be a string or a list of input_text parts", param=f"input[{i}].output")


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) -> chat tools; others are a 400."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ApiError(400, f"tools[{i}]: tool type {kind!r:.40} is not supported; this server runs function tools "
                                "only", param=f"tools[{i}].type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tools[{i}] needs a non-empty string 'name'", param=f"tools[{i}].name")
        fn = {"name": name, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Union[str, dict[str, Any]]) -> Union[str, dict[str, Any]]:
    """"auto" | "none" | "required" as they are; {"type": "function", "name": N} -> chat's named choice."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, f"tool_choice {json.dumps(choice)[:60]} is not supported ('auto', 'none', 'required' or "
                        "{'type': 'function', 'name': ...})", param="tool_choice")


def response_format(fmt: Any) -> Optional[dict[str, Any]]:
    """``text.format`` -> chat completions' response_format (the same constraint: runtime/constraints.py)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format json_schema needs a 'schema' object", param="text.format.schema")
        spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise ApiError(400, f"text.format type must be text, json_object or json_schema, got {kind!r:.40}",
                   param="text.format.type")


# ---- the response: output items, the body, the stream's events -----------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(reply: TurnReply) -> list[dict[str, Any]]:
    """A whole reply's items: reasoning, the message (unless the reply is only calls), each call; the last one is
    "incomplete" when the turn was cut by max_output_tokens."""
    items = []
    if reply.reasoning:
        items.append(reasoning_item(_new_id("rs"), reply.reasoning, "completed"))
    if reply.content or not reply.tool_calls:
        items.append(message_item(_new_id("msg"), reply.content, "completed"))
    for call in reply.tool_calls:
        items.append(call_item(_new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                               "completed"))
    if reply.finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def usage(reply: TurnReply) -> dict[str, Any]:
    """Token counts; ``cache_write_tokens`` is 0: the prefix cache does not count what it stores."""
    return {"input_tokens": reply.input_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": reply.output_tokens, "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
            "total_tokens": reply.input_tokens + reply.output_tokens}


class ResponseHead:
    """The fields of one response that do not depend on the reply: id, created_at, the request's settings echoed."""

    def __init__(self, req: ResponsesRequest, store: bool) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        fmt = (req.text or {}).get("format") or {"type": "text"}
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        self.fields = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": store,
            "temperature": req.temperature, "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": choice,
            "tools": req.tools or [], "top_p": req.top_p, "truncation": "disabled", "metadata": req.metadata or {},
            "user": req.user}

    def body(self, status: str, output: list[dict[str, Any]], reply: TurnReply | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object in ``status``: in_progress (no usage yet), completed, incomplete, failed."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": incomplete, "output": output, **self.fields,
                "usage": usage(reply) if reply is not None else None}


def final_status(reply: TurnReply) -> str:
    return "incomplete" if reply.finish_reason == "length" else "completed"


class EventWriter:
    """A streamed reply's SSE events, numbered: each item opened (output_item.added, content_part.added), its
    deltas, and closed (the .done events) before the next one opens."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []  # every item so far, in its latest state
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # a call's index in the reply -> its item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        body = self.head.body("in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def feed(self, d: Delta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if d.kind == "tool":
            if d.id is not None:
                out += self.close()
                item = call_item(_new_id("fc"), d.id, d.name or "", "", "in_progress")
                self._calls[d.index] = item
                out += self._add(item)
            item = self._calls[d.index]
            if d.text:
                item["arguments"] += d.text
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=d.text))
            return out
        kind = "message" if d.kind == "content" else "reasoning"
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            item = (message_item if kind == "message" else reasoning_item)(_new_id("msg" if kind == "message" else "rs"),
                                                                           "", "in_progress")
            out += self._add(item)
            out.append(self._part("added", item))
        item = self._open
        item["content"][0]["text"] += d.text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(name, item_id=item["id"], output_index=len(self.output) - 1, content_index=0,
                              delta=d.text, **extra))
        return out

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = item
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def _part(self, what: str, item: dict[str, Any]) -> dict[str, Any]:
        return self.event(f"response.content_part.{what}", item_id=item["id"], output_index=self.output.index(item),
                          content_index=0, part=_copy(item["content"][0]))

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The .done events of the open item (``status``: "incomplete" when the turn was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])]
        else:
            text = item["content"][0]["text"]
            name = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out = [self.event(name, item_id=item["id"], output_index=index, content_index=0, text=text, **extra),
                   self._part("done", item)]
        return out + [self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def end(self, reply: TurnReply) -> list[dict[str, Any]]:
        """The open item closed, then response.completed (or response.incomplete, cut by max_output_tokens)."""
        status = final_status(reply)
        out = self.close(status)
        if not self.output:  # an empty reply is still one (empty) message, as the whole response has
            item = message_item(_new_id("msg"), "", "in_progress")
            out += self._add(item) + [self._part("added", item)] + self.close(status)
        body = self.head.body(status, _copy(self.output), reply)
        return out + [self.event(f"response.{status}", response=body)]

    def failed(self, e: ApiError) -> list[dict[str, Any]]:
        code = "rate_limit_exceeded" if e.status == 429 else "server_error"
        body = self.head.body("failed", _copy(self.output), error={"code": code, "message": e.message})
        return [self.event("response.failed", response=body)]


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


# ---- the routes ----------------------------------------------------------------------------------------------------
def add_routes(app: FastAPI, engine: Any, config: Any, metrics: Any, check_model: Callable[[str], Optional[str]]) -> None:
    """POST /v1/responses; GET and DELETE /v1/responses/{id} (stored ones). ``check_model(name)`` -> the adapter."""
    store = ResponseStore(config.responses_store)
    app.state.responses = store

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        req = parse(ResponsesRequest, await request.body())
        adapter = check_model(req.model)
        if req.store and store.size < 1:
            raise ApiError(400, "store is not available: this server keeps no responses (--responses-store 0)",
                           param="store")
        history = store.get(req.previous_response_id, "previous_response_id").items if req.previous_response_id else []
        try:
            run = await ChatRun.start(engine, req.chat_request(history), config.speculative, adapter, metrics.observe)
        except ApiError as e:
            raise responses_error(e) from None
        request.state.job = run.job  # the request log's token counts (serve/guard.py), as the other routes
        head = ResponseHead(req, bool(req.store))

        def keep(body: dict[str, Any]) -> None:
            if req.store:
                store.put(Stored(body, history + req.items + list(body["output"])))

        if req.stream:
            return EventSourceResponse(_stream(run, head, keep), sep="\n", ping=15, shutdown_grace_period=config.drain_s,
                                       send_timeout=config.client_timeout_s)
        reply = await run.whole(request)
        body = head.body(final_status(reply), output_items(reply), reply)
        keep(body)
        return JSONResponse(body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(store.get(response_id).body)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _stream(run: ChatRun, head: ResponseHead, keep: Callable[[dict], None]) -> AsyncIterator[dict[str, str]]:
    """SSE events (``event:`` the type, ``data:`` the JSON), from response.created to response.completed."""
    writer = EventWriter(head)
    try:
        for e in writer.start():
            yield _sse(e)
        try:
            async for d in run.deltas():
                for e in writer.feed(d):
                    yield _sse(e)
        except ApiError as error:
            for e in writer.failed(error):
                yield _sse(e)
            return
        events = writer.end(run.reply)
        keep(events[-1]["response"])
        for e in events:
            yield _sse(e)
    finally:  # done, failed, or cancelled by a disconnect
        run.job.cancel()


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event)}
