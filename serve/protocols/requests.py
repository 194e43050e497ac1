"""The OpenAI request bodies the server accepts, validated strictly (errors: serve/api_error.py).

Types are strict (a string where a number belongs is a 400, not coerced); fields the server
does not know are ignored, as many clients send extras (``user``, ``metadata``). Fields it knows
but cannot honour (``echo``, ``suffix``, ``best_of``) are a 400 rather than silently dropped.
Chat takes ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (runtime/chat/tools.py), and, as vLLM,
``chat_template_kwargs`` and ``enable_thinking``; ``logprobs`` / ``top_logprobs`` and ``logit_bias``
(serve/protocols/logprobs.py). Extensions beyond the OpenAI API, as in vLLM: ``top_k``, ``min_p``, ``repetition_penalty``; and
``speculative`` ("ngram" | "draft" | "off": speculative decoding for this request).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from decodert.errors import DecodertError
from decodert.runtime.chat.tools import check_tools
from decodert.runtime.constraints import Constraint
from decodert.runtime.decoding.sampling import MAX_TOP_LOGPROBS
from decodert.serve.api_error import ApiError

MAX_STOPS = 16  # stop strings per request
MAX_CHOICES = 16  # prompts x n per request
MAX_BIASED = 1024  # logit_bias entries per request
MAX_JSON_DEPTH = 201  # nesting the body's JSON parser (pydantic-core) reads; tests/serve/test_serve_validation.py
MAX_ID_DIGITS = 18  # digits of a logit_bias key (a token id below 2**63)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit); chat's top_logprobs go to MAX_TOP_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


MEDIA_PARTS = ("image_url", "video_url", "input_audio")  # parts handed to the LLM as dicts (decoded there)


class TextPart(_Strict):
    type: str
    text: Optional[str] = None
    image_url: Optional[Union[str, dict[str, Any]]] = None  # {"url": "data:image/png;base64,..."}
    video_url: Optional[Union[str, dict[str, Any]]] = None  # {"url": ["data:image/png;base64,...", ...]}: frames
    fps: Optional[float] = None  # video_url: the rate of its frames
    input_audio: Optional[dict[str, Any]] = None  # {"data": base64, "format": "wav"} (runtime/audio/messages.py)


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # assistant: earlier calls (runtime/chat/tools.py checks them)
    tool_call_id: Optional[str] = None  # role "tool": the call this result answers

    def text(self, i: int) -> Union[str, list[dict[str, Any]]]:
        """The message's text: a string, or its text parts joined (other parts are a 400); with image_url or
        video_url parts, the parts as dicts (runtime/vision/messages.py decodes the images and frames)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(part.type in MEDIA_PARTS for part in self.content):
            other = [part.type for part in self.content if part.type not in ("text", *MEDIA_PARTS)]
            if other:
                raise ApiError(400, f"messages[{i}].content: part type {other[0]!r} is not supported "
                                    "(text, image_url, video_url, input_audio)",
                               param=f"messages[{i}].content")
            return [part.model_dump(exclude_none=True) for part in self.content]
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages[{i}].content: only text parts are supported, got type {part.type!r}",
                               param=f"messages[{i}].content")
        return "".join(part.text or "" for part in self.content)


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None  # text | json_object | json_schema (runtime/constraints.py)
    speculative: Optional[str] = None  # decodert extension: "ngram" | "draft" | "off" (default: the server's --speculative)
    _constraint: Optional[Constraint] = PrivateAttr(default=None)

    def check(self) -> None:
        """Ranges the OpenAI API documents, and fields this server does not implement -> ApiError 400."""
        ranges = (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                  ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0))
        for name, low, high in ranges:
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ApiError(400, f"{name} must be between {low:g} and {high:g}, got {value!r}", param=name)
        if self.top_p is not None and self.top_p == 0:
            raise ApiError(400, "top_p must be > 0", param="top_p")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be between 1 and {MAX_CHOICES}, got {self.n}", param="n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.seed is not None and self.seed < 0:
            raise ApiError(400, f"seed must be >= 0, got {self.seed}", param="seed")
        if len(self.stops) > MAX_STOPS or not all(self.stops):
            raise ApiError(400, f"stop must be at most {MAX_STOPS} non-empty strings", param="stop")
        self._check_logit_bias()
        try:
            self._constraint = Constraint.from_response_format(self.response_format)
        except DecodertError as e:
            raise ApiError(400, str(e), param="response_format") from None
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias or {}
        if len(bias) > MAX_BIASED:
            raise ApiError(400, f"logit_bias has {len(bias)} entries; at most {MAX_BIASED}", param="logit_bias")
        for key, value in bias.items():
            if len(key) > MAX_ID_DIGITS:  # int() of a 5,000-digit key was a ValueError, a 500
                raise ApiError(400, f"logit_bias keys are token ids; {key[:20]!r}... has {len(key)} characters "
                                    f"(at most {MAX_ID_DIGITS} digits)", param="logit_bias")
            if not (key.isascii() and key.isdigit()) or not math.isfinite(value) or not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias maps token ids (decimal strings) to biases between -100 and 100, "
                                    f"got {key[:20]!r}: {value!r}", param="logit_bias")

    def sampling_extras(self) -> dict[str, Any]:
        """SamplingParams fields beyond the shared sampling ones: logit_bias, and logprobs as each endpoint asks."""
        extras: dict[str, Any] = {}
        if self.logit_bias:
            extras["logit_bias"] = tuple((int(k), v) for k, v in self.logit_bias.items())
        return extras

    @property
    def constraint(self) -> Optional[Constraint]:
        """The structured-output constraint response_format asks for (set by ``check``)."""
        return self._constraint

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check(self) -> None:
        super().check()
        if self.echo or self.suffix or (self.best_of or 1) != 1:
            name = "echo" if self.echo else "suffix" if self.suffix else "best_of"
            raise ApiError(400, f"{name} is not supported by this server", param=name)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {self.logprobs}",
                           param="logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ApiError(400, "prompt must not be an empty list", param="prompt")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ApiError(400, f"{len(self.prompts())} prompts x n {self.n} asks for {len(self.prompts()) * self.n} "
                                f"choices; at most {MAX_CHOICES} per request", param="n")

    def sampling_extras(self) -> dict[str, Any]:
        extras = super().sampling_extras()
        if self.logprobs is not None:  # the chosen token's, and the logprobs most likely ones'
            extras.update(logprobs=True, top_logprobs=self.logprobs)
        return extras

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # as vLLM: extra variables for the chat template
    enable_thinking: Optional[bool] = None  # shorthand for chat_template_kwargs {"enable_thinking": ...}

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                           param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        except DecodertError as e:
            raise ApiError(400, str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from None
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ApiError(400, f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}",
                           param="max_completion_tokens")

    def sampling_extras(self) -> dict[str, Any]:
        extras = super().sampling_extras()
        if self.logprobs:
            extras.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return extras

    @property
    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            d.update({k: getattr(m, k) for k in ("tool_calls", "tool_call_id", "name") if getattr(m, k) is not None})
            out.append(d)
        return out

    def chat_options(self) -> dict[str, Any]:
        """The chat options given (runtime/chat/turn.py CHAT_ARGS): tools, tool_choice, thinking, template kwargs."""
        names = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "enable_thinking")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


_UNION_HELP = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': ...} / {'type': 'image_url', ...} / {'type': 'video_url', ...} parts",
}


def parse(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body as ``model`` -> the request object, or ApiError 400 naming the first bad field."""
    if not body.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    request.check()
    return request


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        if "recursion limit" in err["msg"]:  # valid JSON, nested deeper than pydantic's parser reads
            return ApiError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
                                 "(the server's limit)")
        return ApiError(400, f"the request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type":
        return ApiError(400, "the request body must be a JSON object")
    loc = _field_path(err["loc"])
    field = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))
    name = next((p for p in reversed(loc) if isinstance(p, str)), "")
    if err["type"] == "missing":
        return ApiError(400, f"{field} is required", param=field)
    if name in _UNION_HELP and _is_union_error(e, loc):
        return ApiError(400, f"{field} must be {_UNION_HELP[name]}", param=field)
    got = err.get("input")
    return ApiError(400, f"{field}: {err['msg']} (got {_short(got)})", param=field)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "ChatMessage"}


def _field_path(loc: tuple) -> list:
    """A pydantic error location without its union-branch tags ('str', 'list[int]', ...)."""
    return [p for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]


def _is_union_error(e: ValidationError, loc: list) -> bool:
    return sum(1 for err in e.errors() if _field_path(err["loc"])[: len(loc)] == loc) > 1


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
