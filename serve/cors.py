"""CORS: which web origins may call the server from a browser (``--allowed-origins``; default none).

    cors = Cors(("https://app.example", "http://localhost:5173"))   # or ("*",)
    cors.headers(headers)    -> the headers every response to that request carries (Allow-Origin, Vary)
    cors.preflight(headers)  -> the preflight's own headers (Allow-Methods, -Headers, Max-Age); None: refused

- A preflight (OPTIONS with ``Access-Control-Request-Method``) is answered here, before the API key
  and Content-Type checks (browsers never send a key on a preflight): 204 with Allow-Origin, Allow-Methods,
  Allow-Headers and Max-Age for an allowed origin, 403 (one line, no CORS headers) for any other.
- ``Access-Control-Allow-Origin`` is the request's own origin (with ``Vary: Origin``), or ``*`` when "*"
  is configured; it is sent only to allowed origins. Credentials (cookies) are never allowed: a browser
  client sends its key as a header (``Authorization`` or ``x-api-key``).
- Allow-Headers: the API's headers (AUTH_HEADERS) and whatever else the preflight asks for (the SDKs add
  their own ``x-stainless-*`` headers): an allowed origin is trusted with any request header.
"""

from __future__ import annotations

from typing import Mapping

METHODS = "GET, POST, OPTIONS"
AUTH_HEADERS = ("authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta", "openai-beta",
                "anthropic-dangerous-direct-browser-access")
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


class Cors:
    def __init__(self, allowed_origins: tuple[str, ...] = ()) -> None:
        self.any = "*" in allowed_origins
        self.origins = frozenset(o.strip().rstrip("/").lower() for o in allowed_origins if o.strip() != "*")

    def allowed(self, origin: bytes) -> bool:
        return self.any or origin.decode("latin-1").rstrip("/").lower() in self.origins

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, bytes]) -> bool:
        return method == "OPTIONS" and "access-control-request-method" in headers

    def headers(self, headers: Mapping[str, bytes]) -> list[tuple[bytes, bytes]]:
        """Allow-Origin (and Vary) for a request from an allowed origin; nothing for any other."""
        origin = headers.get("origin")
        if origin is None or not self.allowed(origin):
            return []
        if self.any:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]

    def preflight(self, headers: Mapping[str, bytes]) -> dict[str, str] | None:
        """A preflight's answer headers beyond ``headers()`` (an allowed origin), or None (any other: 403)."""
        if not self.headers(headers):
            return None
        raw = headers.get("access-control-request-headers", b"").decode("latin-1")
        asked = [h.strip().lower() for h in raw.split(",") if h.strip()]
        return {"Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": str(MAX_AGE_S),
                "Access-Control-Allow-Headers": ", ".join(dict.fromkeys([*AUTH_HEADERS, *asked]))}
