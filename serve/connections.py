"""uvicorn's HTTP protocol with a deadline on request headers (slow-loris protection).

uvicorn closes a connection that stays idle after a response (``timeout_keep_alive``), but a
connection whose request headers never complete is never closed: neither h11 nor uvicorn times
the header phase (a client sending one header byte now and then, or nothing at all after
connecting, holds a socket and a file descriptor for ever). Here every connection gets a timer
when it opens and again after each response: when it fires and no new request's headers have
been parsed since (uvicorn starts a new request cycle only then), the connection is closed.

    uvicorn.Config(app, http=http_protocol(header_timeout_s=30))

The body phase is the app's concern (serve/guard.py: 408 after ``--client-timeout``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


class _HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    header_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before uvicorn starts a pipelined request (that one then counts as arrived)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        """Wait for the next request's headers: the cycle in place now must be replaced in time."""
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired, self.cycle)

    def _expired(self, cycle: Any) -> None:
        self._header_timer = None
        if self.cycle is cycle and not self.transport.is_closing():  # no request's headers arrived since
            self.transport.close()


def http_protocol(header_timeout_s: float) -> type:
    """uvicorn's protocol class (``Config(http=...)``) closing connections whose headers take longer than this."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,), {"header_timeout_s": float(header_timeout_s)})
