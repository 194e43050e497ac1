"""The responses a server keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded.

    store = ResponseStore(size)            # size 0: keeps nothing
    store.put(Stored(body, items))         # the newest; beyond ``size`` the least recently used is dropped
    store.get(id).items                    # ApiError 404 for an id never stored, deleted or evicted

Used from the server's event loop only (handlers run there, one at a time between awaits): no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from decodert.serve.api_error import ApiError


@dataclass
class Stored:
    body: dict[str, Any]  # the response object, as it was answered
    items: list[dict[str, Any]]  # its whole history as input items: earlier turns, its input, its output


class ResponseStore:
    """At most ``size`` stored responses, least recently used (stored, continued or read) dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        if self.size < 1:
            return
        key = stored.body["id"]
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self._entries.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r:.80} (responses are kept only with store: true, the "
                                f"{self.size} most recently used)", param=param, code="not_found")
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def __len__(self) -> int:
        return len(self._entries)
