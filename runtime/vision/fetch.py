"""Remote image URLs, for a server started with --allow-image-urls: one total deadline per fetch, a bounded
number of fetches at once, each in a thread of its own.

    fetch = Fetcher(limits, deadline_s=10.0, max_fetches=8)
    data = fetch("https://example.com/cat.png", "message 0 image 1")   # bytes, or a one-line DecodertError

- The deadline is the whole fetch's (connect, redirects, headers, body), not one read's: a host that sends a byte
  every 5 s is cut off at the deadline. The caller waits for the fetch's thread at most until then, then shuts its
  socket down (which ends the thread's blocking read) and raises.
- At most ``max_fetches`` run at once, for the whole server; one more is refused at once (Busy: a server answers
  503) instead of waiting behind slow hosts. A fetch holds its place until its thread has really ended (a name
  lookup cannot be interrupted), so the threads are bounded too, and the server's request threads (where the
  caller waits) are never all taken by slow hosts.
- Redirects (301, 302, 303, 307, 308) are followed up to ``max_redirects`` times, to http(s) URLs only; bytes
  over ``limits.max_bytes`` are refused (from Content-Length before reading, else after max_bytes + 1).
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse

from decodert.errors import Busy, DecodertError, first_line
from decodert.runtime.vision.images import DEFAULT_LIMITS, ImageLimits

REDIRECTS = (301, 302, 303, 307, 308)


class Fetcher:
    """``fetch(url, what) -> bytes`` under the rules of the module docstring; safe to call from many threads."""

    def __init__(self, limits: ImageLimits = DEFAULT_LIMITS, deadline_s: float = 10.0, max_fetches: int = 8,
                 max_redirects: int = 5) -> None:
        if not deadline_s > 0 or max_fetches < 1 or max_redirects < 0:
            raise DecodertError(f"image fetches need a deadline > 0 s and at least one at a time, got "
                                f"{deadline_s} s and {max_fetches}")
        self.limits, self.deadline_s, self.max_fetches, self.max_redirects = limits, deadline_s, max_fetches, max_redirects
        self._places = threading.BoundedSemaphore(max_fetches)

    def __call__(self, url: str, what: str) -> bytes:
        if not self._places.acquire(blocking=False):
            raise Busy(f"{what}: {self.max_fetches} image fetches are running already (the server's limit, "
                       "--max-image-fetches); retry later")
        fetch = _Fetch(url, what, self.limits, self.max_redirects, time.monotonic() + self.deadline_s)
        try:
            threading.Thread(target=self._run, args=(fetch,), name="decodert-fetch", daemon=True).start()
        except BaseException:
            self._places.release()
            raise
        if not fetch.done.wait(self.deadline_s):
            fetch.abort()
            raise DecodertError(f"{what}: fetching {url[:100]!r} took longer than {self.deadline_s:g} s "
                                "(the deadline of one image fetch, --image-fetch-timeout)")
        if fetch.error is not None:
            raise fetch.error
        return fetch.data

    def _run(self, fetch: "_Fetch") -> None:
        try:
            fetch.run()
        finally:
            self._places.release()


class _Fetch:
    """One fetch, run by its own thread; ``abort()`` from the waiting thread ends it."""

    def __init__(self, url: str, what: str, limits: ImageLimits, max_redirects: int, deadline: float) -> None:
        self.url, self.what, self.limits, self.max_redirects, self.deadline = url, what, limits, max_redirects, deadline
        self.done = threading.Event()
        self.data = b""
        self.error: DecodertError | None = None
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def run(self) -> None:
        try:
            self.data = self._get()
        except DecodertError as e:
            self.error = e
        except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, TLS, a bad port or name
            self.error = self._failed(f"{type(e).__name__}: {first_line(e)}" if first_line(e) else type(e).__name__)
        finally:
            with self._lock:
                self._close()
            self.done.set()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._conn.sock if self._conn is not None else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's blocking read; close() alone does not
                except OSError:
                    pass

    def _failed(self, why: str) -> DecodertError:
        return DecodertError(f"{self.what}: fetching {self.url[:100]!r} failed ({why})")

    def _get(self) -> bytes:
        url = self.url
        for _ in range(self.max_redirects + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise self._failed(f"{url[:100]!r} is not an http(s) URL")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._failed("the deadline passed")
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = kind(parts.hostname, parts.port, timeout=left)
            with self._lock:
                if self._aborted:
                    raise self._failed("aborted")
                self._close()
                self._conn = conn
            conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                         headers={"User-Agent": "decodert", "Accept": "image/*"})
            response = conn.getresponse()
            if response.status in REDIRECTS:
                location = response.getheader("Location")
                if not location:
                    raise self._failed(f"HTTP {response.status} without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            if response.status != 200:
                raise self._failed(f"HTTP {response.status} {response.reason[:60]}".strip())
            return self._body(response)
        raise self._failed(f"more than {self.max_redirects} redirects (a redirect loop?)")

    def _body(self, response: http.client.HTTPResponse) -> bytes:
        limit = self.limits.max_bytes
        declared = response.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared[:19]) > limit:
            raise DecodertError(f"{self.what} at {self.url[:100]!r} is {int(declared)} bytes; the limit is {limit}")
        data = response.read(limit + 1)
        if len(data) > limit:
            raise DecodertError(f"{self.what} at {self.url[:100]!r} is over {limit} bytes (the limit)")
        return data

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
