"""The host tier: adapters kept read, checked and prepared in host memory, so
that loading one into a slot costs only the slot write; and the reads that
fill it, started the moment a request needs an adapter (prefetch).

Plain Python on the event loop: it holds prepared rows (made on the reader
thread) but never computes with them. Entries are keyed by record, and a
record is one version of one name: a name loaded again is a new record, so
it never finds the old version's rows. Limits: ``max_entries``
(--max-cpu-loras) and ``max_bytes`` (--adapter-cache-bytes), either or both;
over them, the least recently used entries go, except those of adapters that
requests run on or wait for (``AdapterRecord.is_pinned``): while more
adapters than the limits allow are in use at once, the tier holds more.

With neither limit set the tier is off: rows read for a request that waits
for a slot are held only until they are written, as a load without a host
tier would hold them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

from ..adapters.loader import PreparedAdapter
from .records import AdapterRecord, AdapterState

Read = Callable[[], Awaitable[PreparedAdapter]]
Done = Callable[[AdapterRecord, BaseException | None], None]


@dataclass
class TierStats:
    hits: int = 0  # slot loads for waiting requests whose rows were here already
    misses: int = 0  # slot loads that had to wait for a disk read
    reads: int = 0  # disk reads started (prefetches and checks of new adapters)
    read_failures: int = 0
    evictions: int = 0  # entries dropped to keep within the limits


@dataclass
class _Entry:
    prepared: PreparedAdapter
    fresh: bool  # read for a slot load still to come (that load is a miss)


class HostTier:
    def __init__(self, max_entries: int | None = None, max_bytes: int | None = None):
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.nbytes = 0  # host memory the entries take
        self._entries: dict[AdapterRecord, _Entry] = {}  # in the order they came
        self._reads: dict[AdapterRecord, asyncio.Task] = {}

    @property
    def enabled(self) -> bool:
        limits = [v for v in (self.max_entries, self.max_bytes) if v is not None]
        return bool(limits) and all(limits)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, record: AdapterRecord) -> bool:
        return record in self._entries

    def is_reading(self, record: AdapterRecord) -> bool:
        return record in self._reads

    def describe(self) -> dict:
        return {"enabled": self.enabled, "entries": len(self), "bytes": self.nbytes,
                "max_entries": self.max_entries, "max_bytes": self.max_bytes,
                "reading": len(self._reads), **vars(self.stats)}

    # ---- entries ----------------------------------------------------------------

    def put(self, record: AdapterRecord, prepared: PreparedAdapter, fresh: bool = False) -> None:
        """Keep ``prepared`` for ``record``."""
        self.drop(record)
        self._entries[record] = _Entry(prepared, fresh)
        self.nbytes += prepared.host_bytes
        record.cached = True
        self.settle()

    def peek(self, record: AdapterRecord) -> PreparedAdapter | None:
        """The rows of ``record``, or None, counting nothing."""
        entry = self._entries.get(record)
        return entry.prepared if entry is not None else None

    def take(self, record: AdapterRecord, count: bool = True) -> PreparedAdapter | None:
        """The rows of ``record`` for a slot write, or None; with ``count``,
        a hit or a miss of a load for waiting requests."""
        entry = self._entries.get(record)
        if entry is None:
            return None
        if count:
            if entry.fresh:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        entry.fresh = False
        return entry.prepared

    def drop(self, record: AdapterRecord) -> None:
        """Forget ``record``'s rows (it was unloaded, replaced, or evicted)."""
        entry = self._entries.pop(record, None)
        if entry is not None:
            self.nbytes -= entry.prepared.host_bytes
            record.cached = False

    def settle(self) -> None:
        """Drop what the limits (or a disabled tier) do not allow, least
        recently used first (by the adapter's last request), never the rows
        of a pinned record."""
        for record in sorted(self._entries, key=lambda r: r.last_used or 0.0):
            if not self._over():
                return
            if self._keep(record):
                continue
            self.drop(record)
            self.stats.evictions += self.enabled

    def _keep(self, record: AdapterRecord) -> bool:
        if record.state is AdapterState.REMOVED:
            return False
        if not self.enabled:  # only rows that waiting requests still need written
            return record.waiting > 0 and not record.resident
        return record.is_pinned

    def _over(self) -> bool:
        if not self.enabled:
            return bool(self._entries)
        if self.max_entries is not None and len(self._entries) > self.max_entries:
            return True
        return self.max_bytes is not None and self.nbytes > self.max_bytes

    # ---- reads --------------------------------------------------------------------

    def prefetch(self, record: AdapterRecord, read: Read, done: Done) -> None:
        """Start reading ``record`` unless its rows are here or on their way;
        ``done(record, error)`` is called when the read ends (error None: its
        rows are here)."""
        if record in self._entries or record in self._reads:
            return
        self.stats.reads += 1
        task = asyncio.get_running_loop().create_task(self._read(record, read, done))
        self._reads[record] = task

    async def _read(self, record: AdapterRecord, read: Read, done: Done) -> None:
        try:
            prepared = await read()
        except BaseException as e:  # every waiter of this record gets it
            self._reads.pop(record, None)
            self.stats.read_failures += 1
            done(record, e)
            if not isinstance(e, Exception):
                raise
            return
        self._reads.pop(record, None)
        if record.state is not AdapterState.REMOVED:
            self.put(record, prepared, fresh=True)
        done(record, None)

    def cancel_reads(self) -> None:
        for task in list(self._reads.values()):
            task.cancel()
