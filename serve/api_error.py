"""The error every route answers with: an HTTP status and OpenAI's error JSON (the Anthropic routes reshape it,
serve/protocols/anthropic.py ``error_body``). Below both the HTTP side and the protocols, which all raise it."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
