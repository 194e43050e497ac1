"""ASGI middleware in front of every route: the API key, the body size limit and request counting.

- ``/v1/*`` needs ``Authorization: Bearer KEY`` when a key is set (compared in constant time);
  ``/health`` and ``/metrics`` stay open for probes and scrapers.
- A body over ``max_body_bytes`` is refused with 413, by its Content-Length before it is read,
  or as soon as the bytes received pass the limit.
- Every response's status is counted per endpoint (unknown paths count as "other").
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _TooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: Any) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")
        status: list[int] = []

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            refusal = self._refuse(scope, path)
            if refusal is not None:
                return await _error(counted_send, *refusal)
            await self.app(scope, self._limited(receive), counted_send)
        except _TooLarge:
            if status:
                raise
            await _error(counted_send, 413, f"the request body is over the limit of {self.max_body} bytes (--max-body-bytes)",
                         "invalid_request_error", "request_too_large")
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] if status else 499)).inc()

    def _refuse(self, scope: Scope, path: str) -> tuple | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", ())}
        if self.key is not None and path.startswith("/v1/"):
            auth = headers.get("authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                what = "missing" if not auth else "wrong"
                return (401, f"the API key is {what}; send it as 'Authorization: Bearer KEY'", "invalid_request_error",
                        "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            bad = not length.isdigit()
            return (400 if bad else 413, "the Content-Length header is not a number" if bad else
                    f"the request body is over the limit of {self.max_body} bytes (--max-body-bytes)",
                    "invalid_request_error", None if bad else "request_too_large")
        return None

    def _limited(self, receive):
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge()
            return message

        return wrapped


async def _error(send, status: int, message: str, type: str, code: str | None, headers: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
