"""ASGI middleware in front of every route: the API key, the body size limit and request counting.

- ``/v1/*`` needs ``Authorization: Bearer KEY`` when a key is set (compared in constant time);
  ``/health`` and ``/metrics`` stay open for probes and scrapers.
- A body over ``max_body_bytes`` is refused with 413, by its Content-Length before it is read,
  or as soon as the bytes received pass the limit.
- A body that has not fully arrived ``body_timeout_s`` after the request began is refused with
  408 (a client sending byte by byte, or stalling, holds its connection that long at most).
- Every response's status is counted per endpoint (unknown paths count as "other").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, Awaitable, Callable

from sse_starlette.sse import SendTimeoutError

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: Any,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes
        self.body_timeout = body_timeout_s
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
        except SendTimeoutError:  # a stream reader that stopped taking bytes: its stream was closed, drop it
            self.metrics.stalled_readers.inc()
        except _BodyRefused as e:
            if status:
                raise
            await _error(counted_send, e.status, e.message, "invalid_request_error", e.code)
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
        """``receive`` with the size limit and, until the body is complete, the deadline (later
        receives, which wait for a disconnect, are not bounded)."""
        seen, complete, deadline = 0, False, time.monotonic() + self.body_timeout

        async def wrapped() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _BodyRefused(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                        "(--client-timeout)", "request_timeout") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_body:
                    raise _BodyRefused(413, f"the request body is over the limit of {self.max_body} bytes "
                                            "(--max-body-bytes)", "request_too_large")
            else:
                complete = True
            return message

        return wrapped


async def _error(send, status: int, message: str, type: str, code: str | None, headers: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
