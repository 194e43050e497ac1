"""ASGI middleware in front of every route: the Host and CORS checks, the API key, the body size limit,
request counting and the request log.

- ``/v1/*`` needs the key when one is set, as ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (the
  Anthropic SDK's header), compared in constant time; ``/health`` and ``/metrics`` stay open for probes
  and scrapers.
- CORS (serve/cors.py): a preflight is answered before the key and Content-Type checks (204 for an
  origin in ``allowed_origins``, 403 otherwise), and every response to an allowed origin carries
  ``Access-Control-Allow-Origin``.
- A body over ``max_body_bytes`` is refused with 413, by its Content-Length before it is read,
  or as soon as the bytes received pass the limit.
- A body that has not fully arrived ``body_timeout_s`` after the request began is refused with
  408 (a client sending byte by byte, or stalling, holds its connection that long at most).
- The ``Host`` header must name this server: a loopback name (127.0.0.1, localhost, [::1]), the
  address the connection came in on (host:port), or one of ``allowed_hosts`` ("*": any); others
  get 421, so a web page cannot reach the server through DNS rebinding.
- POSTs to ``/v1/*`` need ``Content-Type: application/json`` (415 otherwise): a web page cannot
  send that cross-origin without a CORS preflight, which only the origins in ``allowed_origins`` are
  granted (none by default); a page of any other origin cannot post to the API at all.
  The one exception, ``MULTIPART_PATHS`` (OpenAI's /v1/audio/transcriptions takes multipart/form-data, which a
  page may post without a preflight): a browser always names the page's ``Origin`` on such a POST, so a multipart
  upload with an Origin header is refused (403) unless that origin is allowed or the request carries an
  Authorization / x-api-key header (which a page cannot add without a preflight); curl and the SDKs send no Origin.
- A client that closes the connection before its body arrived is one log line, counted as 499.
- Every response's status is counted per endpoint (unknown paths count as "other"), and logged at info
  (``--log-level info``) as one line: method, path, status, prompt and completion tokens where the
  route ran a job (``request.state.job``), milliseconds; never a body, a header or a key.
- Errors on the Anthropic routes are in Anthropic's shape (serve/protocols/anthropic.py ``error_body``).
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

from decodert.serve.protocols import anthropic
from decodert.serve.cors import Cors

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/models",
             "/v1/audio/transcriptions", "/health", "/metrics")
MULTIPART_PATHS = ("/v1/audio/transcriptions",)  # POSTs that take multipart/form-data (with an auth header)
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
log = logging.getLogger("uvicorn.error")  # the server's log, at its --log-level


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: Any,
                 body_timeout_s: float = 30.0, allowed_hosts: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.cors = Cors(allowed_origins)
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
        began = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", ())}
        cors = self.cors.headers(headers)

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if cors:
                    message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)

        scope.setdefault("state", {})  # where a route leaves its job (request.state.job) for the log line
        try:
            refusal = self._refuse(scope, path, headers)
            if refusal is not None:
                return await _error(counted_send, path, *refusal)
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
            await _error(counted_send, path, e.status, e.message, "invalid_request_error", e.code)
        finally:
            code = status[0] if status else 499
            self.metrics.requests.labels(endpoint, str(code)).inc()
            if log.isEnabledFor(logging.INFO):
                job = (scope.get("state") or {}).get("job")
                tokens = " prompt_tokens=%d completion_tokens=%d" % job.tokens() if job is not None else ""
                log.info("%s %s %d%s %.1f ms", scope.get("method", ""), path, code, tokens,
                         (time.perf_counter() - began) * 1000)

    def _refuse(self, scope: Scope, path: str, headers: dict[str, bytes]) -> tuple | None:
        host = headers.get("host")
        if host is not None and not self._host_allowed(host.decode("latin-1").strip().lower(), scope.get("server")):
            return (421, f"the Host header {host.decode('latin-1')[:100]!r} does not name this server; start it "
                         "with --allowed-hosts NAME to accept it (DNS-rebinding protection)", "invalid_request_error",
                    "host_not_allowed")
        if Cors.is_preflight(scope.get("method", ""), headers):
            answer = self.cors.preflight(headers)
            if answer is None:
                origin = headers.get("origin", b"").decode("latin-1")[:100]
                return (403, f"cross-origin requests from {origin!r} are not allowed; start the server with "
                             "--allowed-origins ORIGIN to allow them", "invalid_request_error", "origin_not_allowed")
            return (204, "", "", None, answer)
        if self.key is not None and path.startswith("/v1/"):
            auth = headers.get("authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if "x-api-key" in headers and not auth:
                scheme, given = b"bearer", headers["x-api-key"]
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                what = "missing" if not auth and "x-api-key" not in headers else "wrong"
                return (401, f"the API key is {what}; send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                        "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        kind = headers.get("content-type", b"").split(b";")[0].strip().lower()
        if kind == b"multipart/form-data" and path in MULTIPART_PATHS and scope.get("method") == "POST":
            origin = headers.get("origin")
            authorized = "authorization" in headers or "x-api-key" in headers  # a page must preflight to add one
            if origin is not None and not authorized and not self.cors.allowed(origin):
                return (403, f"a multipart upload from the web origin {origin.decode('latin-1')[:100]!r} is not "
                             "allowed; start the server with --allowed-origins ORIGIN to allow it",
                        "invalid_request_error", "origin_not_allowed")
        elif scope.get("method") == "POST" and path.startswith("/v1/") and kind != b"application/json":
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


async def _error(send, path: str, status: int, message: str = "", type: str = "", code: str | None = None,
                 headers: dict | None = None) -> None:
    """A refusal in the route's error shape (OpenAI's; Anthropic's on its routes); 204: an empty preflight answer
    (the CORS headers are added by the guard's send)."""
    if status == 204:
        raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": 204, "headers": raw})
        return await send({"type": "http.response.body", "body": b""})
    shaped = anthropic.error_body(status, message) if anthropic.speaks(path) else \
        {"error": {"message": message, "type": type, "param": None, "code": code}}
    body = json.dumps(shaped).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
