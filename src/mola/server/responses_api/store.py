"""The responses kept for ``previous_response_id``: a bounded, in-memory,
least-recently-used map, read and written on the event loop only.

Each entry holds the Response object (for GET /v1/responses/{id}) and the
conversation up to and including its output, as canonical input items, so a
follow-up request prepends them to its own input. Entries share their item
dicts with their ancestors (a tuple of references), so a long chain costs a
pointer per item per response, not a copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ...errors import ResponseNotFound

# Ids of evicted responses remembered (per stored slot) so that a request
# naming one hears "evicted" rather than "unknown".
EVICTED_MEMORY = 8


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was returned
    items: tuple[dict, ...]  # the conversation: earlier items, this input, this output


class ResponseStore:
    def __init__(self, capacity: int = 1024):
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            old, _ = self._entries.popitem(last=False)
            self._evicted[old] = None
            if len(self._evicted) > EVICTED_MEMORY * self.capacity:
                self._evicted.popitem(last=False)

    def get(self, response_id: str, param: str | None = "previous_response_id") -> StoredResponse:
        """The entry (now the most recently used), or ResponseNotFound saying
        why there is none."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
            return entry
        if response_id in self._evicted:
            raise ResponseNotFound(
                f"Response '{response_id}' was evicted from this server's in-memory store, which "
                f"keeps the {self.capacity} most recently used responses (--max-stored-responses); "
                "send the conversation as input items instead.", param=param)
        raise ResponseNotFound(
            f"No stored response has id '{response_id}': responses are kept only in this server "
            "process's memory, and not at all when created with store: false.", param=param)

    def delete(self, response_id: str) -> None:
        self.get(response_id, param=None)
        del self._entries[response_id]
