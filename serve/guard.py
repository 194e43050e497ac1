"""ASGI middleware in front of every route: the API key, the body size limit and request counting.

- ``/v1/*`` needs ``Authorization: Bearer KEY`` when a key is set (compared in constant time);
  ``/health`` and ``/metrics`` stay open for probes and scrapers.
- A body over ``max_body_bytes`` is refused with 413, by its Content-Length before it is read,
  or as soon as the bytes received pass the limit.
- A body that has not fully arrived ``body_timeout_s`` after the request began is refused with
  408 (a client sending byte by byte, or stalling, holds its connection that long at most).
- The ``Host`` header must name this server: a loopback name (127.0.0.1, localhost, [::1]), the
  address the connection came in on (host:port), or one of ``allowed_hosts`` ("*": any); others
  get 421, so a web page cannot reach the server through DNS rebinding.
- POSTs to ``/v1/*`` need ``Content-Type: application/json`` (415 otherwise): a web page cannot
  send that cross-origin without a CORS preflight, which this server never grants.
- A client that closes the connection before its body arrived is one log line, counted as 499.
- Every response's status is counted per endpoint (unknown paths count as "other").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, Awaitable, Callable

from sse_starlette.sse import SendTimeoutError
from starlette.requests import ClientDisconnect

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics")
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
log = logging.getLogger("uvicorn.error")  # the server's log, at its --log-level


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: Any,
                 body_timeout_s: float = 30.0, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = frozenset(h.strip().lower() for h in allowed_hosts)
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
        except ClientDisconnect:  # gone before its body arrived: nothing to answer, no traceback (counted 499)
            client = scope.get("client") or ("?", 0)
            log.warning("%s:%s closed the connection before its request body arrived (%s %s)", client[0], client[1],
                        scope.get("method", ""), path)
        except _BodyRefused as e:
            if status:
                raise
            await _error(counted_send, e.status, e.message, "invalid_request_error", e.code)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] if status else 499)).inc()

    def _refuse(self, scope: Scope, path: str) -> tuple | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", ())}
        host = headers.get("host")
        if host is not None and not self._host_allowed(host.decode("latin-1").strip().lower(), scope.get("server")):
            return (421, f"the Host header {host.decode('latin-1')[:100]!r} does not name this server; start it "
                         "with --allowed-hosts NAME to accept it (DNS-rebinding protection)", "invalid_request_error",
                    "host_not_allowed")
        if self.key is not None and path.startswith("/v1/"):
            auth = headers.get("authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                what = "missing" if not auth else "wrong"
                return (401, f"the API key is {what}; send it as 'Authorization: Bearer KEY'", "invalid_request_error",
                        "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        kind = headers.get("content-type", b"").split(b";")[0].strip().lower()
        if scope.get("method") == "POST" and path.startswith("/v1/") and kind != b"application/json":
            return (415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
                         f"{kind.decode('latin-1')[:60]!r}", "invalid_request_error", "unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            bad = not length.isdigit()
            return (400 if bad else 413, "the Content-Length header is not a number" if bad else
                    f"the request body is over the limit of {self.max_body} bytes (--max-body-bytes)",
                    "invalid_request_error", None if bad else "request_too_large")
        return None

    def _host_allowed(self, host: str, server: tuple | None) -> bool:
        """``host`` ("name" or "name:port", IPv6 in brackets) names a loopback address, the address the
        connection came in on, or an allowed host (by name, or name:port)."""
        if self.any_host or host in self.hosts:
            return True
        name, port = _split_host(host)
        if name in LOOPBACK_NAMES or name in self.hosts:
            return True
        return server is not None and name == str(server[0]).lower() and port in ("", str(server[1]))

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


def _split_host(host: str) -> tuple[str, str]:
    """A Host header -> (name, port or ""): "a:80", "[::1]:80", "[::1]", "a"."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else ""
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name, port
    return host, ""  # a name, or a bare IPv6 address


async def _error(send, status: int, message: str, type: str, code: str | None, headers: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
