"""The responses `previous_response_id` can name: in memory, bounded, least recently
used first out. A stored response keeps the conversation it ends (chat-shaped messages,
without its `instructions`, which OpenAI does not carry to the next turn) and its body
(for `GET /v1/responses/{id}`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    messages: list[dict[str, Any]]  # the conversation up to and with this response
    body: dict[str, Any]
    tenant: str | None  # only the API key that made it may continue or read it


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size  # 0: nothing is kept
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, stored: Stored) -> None:
        if self.size <= 0:
            return
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)  # the least recently used

    def get(self, rid: str, tenant: str | None) -> Stored | None:
        """The response, marked as just used; None when unknown, evicted or another
        tenant's (indistinguishable to the caller, so ids leak nothing)."""
        stored = self._items.get(rid)
        if stored is None or stored.tenant != tenant:
            return None
        self._items.move_to_end(rid)
        return stored
