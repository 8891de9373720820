"""The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory,
bounded, the least recently used dropped first.

Each entry is one finished response (``completed`` or ``incomplete``; a request with ``store:
false`` or a failed one keeps nothing): its ``response`` object and its ``conversation``, the
chat messages of its input (a previous response's conversation included, its ``instructions``
not, as the API does not carry them over) and its output. An entry's size is the length of the
two as JSON (bytes); the store holds at most ``max_entries`` entries and ``max_bytes`` bytes, so a
daemon's memory for it is bounded whatever clients send. Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

MAX_ENTRIES = 4096
"""Responses kept at most."""
MAX_BYTES = 64 << 20
"""Bytes (response objects and conversations as JSON) kept at most."""


@dataclass(frozen=True)
class StoredResponse:
    """One kept response: its ``response`` object, its ``conversation`` (chat messages) and its
    ``size`` in bytes."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int


class ResponseStore:
    """Kept responses by id (module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (by its ``id``) with its ``conversation``, dropping the least recently
        used entries to make room; False (nothing kept) when it alone is over ``max_bytes``."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        while self._entries and (
            len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes
        ):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry of ``response_id`` (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; False when it was not kept."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
