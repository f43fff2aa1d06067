"""Stacks: several adapters applied together to one request, built into one
slot of their own.

The sum of LoRA deltas is one LoRA whose A is the parts' A side by side and
whose B is their scaled B stacked (``weights.stack_weights``). A stack is keyed by
its parts' names, versions and scales, so a reloaded part never serves an old
stack; it is built on first use, evicted like any adapter, and dropped when a
part is unloaded.
"""

from __future__ import annotations

from collections.abc import Iterator

from .records import AdapterRecord


def stack_key(parts: list[tuple[AdapterRecord, float]]) -> str:
    """``a@v1*0.5+b@v3*1``: a sum, so the order of the parts does not matter."""
    return "+".join(f"{r.name}@v{r.version}*{scale:g}" for r, scale in sorted(parts, key=lambda p: p[0].name))


class Stacks:
    def __init__(self, uids: Iterator[int]):
        self.uids = uids  # the catalog's counter
        self._by_key: dict[str, AdapterRecord] = {}

    def __iter__(self):
        return iter(list(self._by_key.values()))

    def get_or_make(self, parts: list[tuple[AdapterRecord, float]]) -> AdapterRecord:
        """The stack of these (record, request scale) parts, made if new."""
        key = stack_key(parts)
        record = self._by_key.get(key)
        if record is None:
            parts = sorted(parts, key=lambda p: p[0].name)
            record = AdapterRecord(
                name=key, path=" + ".join(r.path for r, _ in parts), source="stack", version=1, uid=next(self.uids),
                parts=tuple((r.path, r.slot_scale * scale) for r, scale in parts),
                part_records=tuple(r for r, _ in parts),
            )
            self._by_key[key] = record
        return record

    def is_current(self, record: AdapterRecord) -> bool:
        return self._by_key.get(record.name) is record

    def drop(self, record: AdapterRecord) -> None:
        if self.is_current(record):
            del self._by_key[record.name]

    def using(self, part: AdapterRecord) -> list[AdapterRecord]:
        """The stacks built from ``part``."""
        return [r for r in self._by_key.values() if part in r.part_records]
