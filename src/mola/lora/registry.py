"""Model id -> slot: which adapters are served, where they live, and who is
using them.

Plain Python on the event loop. A request takes a :class:`Lease` on the model
id it names and returns it when it ends; an unloaded adapter stops taking new
leases at once, and its slot is zeroed and freed only when the last lease
comes back, so no running request is cut short or silently moved to the base.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import AdapterExists, AdapterNotFound, InvalidRequest, ModelNotFound, NoFreeSlot
from .weights import LoRAWeights

log = logging.getLogger("mola.adapters")


class SlotBackend(Protocol):
    async def read(self, path: str) -> LoRAWeights: ...
    async def write(self, slot: int, weights: LoRAWeights) -> None: ...
    async def clear(self, slot: int) -> None: ...


@dataclass
class AdapterEntry:
    name: str
    path: str  # as given; /v1/models reports it as `root`
    slot: int
    version: int  # counts loads of this name: a reload is a new version
    created: int = field(default_factory=lambda: int(time.time()))
    state: str = "loading"  # "loading" -> "ready" -> "draining"
    rank: int = 0
    scale: float | None = None
    format: str = ""
    nbytes: int = 0
    in_flight: int = 0  # leases held by requests
    last_used: float | None = None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "format": self.format,
            "state": self.state,
            "slot": self.slot,
            "version": self.version,
            "rank": self.rank,
            "scale": self.scale,
            "nbytes": self.nbytes,
            "in_flight": self.in_flight,
            "created": self.created,
            "last_used": self.last_used,
        }


class Lease:
    """A request's hold on a model id. ``release`` is idempotent."""

    def __init__(self, registry: "AdapterRegistry", entry: AdapterEntry | None):
        self._registry = registry
        self.entry = entry  # None: the base model
        self.slot = entry.slot if entry else 0
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self)


class AdapterRegistry:
    def __init__(self, base_id: str, backend: SlotBackend, max_loras: int):
        self.base_id = base_id
        self.backend = backend
        self.max_loras = max_loras
        self._by_name: dict[str, AdapterEntry] = {}
        self._free_slots = list(range(max_loras, 0, -1))  # pop() gives the lowest
        self._draining: set[int] = set()  # entry ids waiting for their last lease
        self._versions: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()

    # ---- lookups ------------------------------------------------------------

    def adapters(self) -> list[AdapterEntry]:
        return [e for e in self._by_name.values() if e.state == "ready"]

    def all_entries(self) -> list[AdapterEntry]:
        return list(self._by_name.values())

    def get(self, name: str) -> AdapterEntry:
        entry = self._by_name.get(name)
        if entry is None or entry.state != "ready":
            raise AdapterNotFound(name)
        return entry

    def acquire(self, model_id: str) -> Lease:
        """A lease on the base model or a ready adapter; ModelNotFound else."""
        if model_id == self.base_id:
            return Lease(self, None)
        entry = self._by_name.get(model_id)
        if entry is None or entry.state != "ready":
            raise ModelNotFound(model_id)
        entry.in_flight += 1
        entry.last_used = time.time()
        return Lease(self, entry)

    def _release(self, lease: Lease) -> None:
        entry = lease.entry
        if entry is None:
            return
        entry.in_flight -= 1
        if entry.state == "draining" and entry.in_flight == 0:
            self._spawn(self._free(entry))

    # ---- load / unload ------------------------------------------------------

    async def load(self, name: str, path: str) -> AdapterEntry:
        """Read, check and install the adapter at ``path`` as ``name``."""
        if not name or not name.strip() or name != name.strip():
            raise InvalidRequest(
                f"Invalid adapter name {name!r}: it must be non-empty without surrounding spaces.",
                param="name",
            )
        if name == self.base_id or name in self._by_name:
            raise AdapterExists(name)
        if not self._free_slots:
            raise NoFreeSlot(
                f"All {self.max_loras} adapter slots are in use; unload an adapter "
                "or restart with a larger --max-loras."
            )
        slot = self._free_slots.pop()
        version = self._versions.get(name, 0) + 1
        entry = AdapterEntry(name=name, path=str(path), slot=slot, version=version)
        self._by_name[name] = entry  # reserves the name while loading
        t0 = time.perf_counter()
        try:
            weights = await self.backend.read(str(path))
            await self.backend.write(slot, weights)
        except BaseException:
            del self._by_name[name]
            self._free_slots.append(slot)
            self._free_slots.sort(reverse=True)
            raise
        self._versions[name] = version
        entry.rank, entry.scale, entry.format = weights.rank, weights.scale, weights.format
        entry.nbytes = weights.nbytes
        entry.state = "ready"
        log.info(
            "adapter loaded: name=%s version=%d slot=%d rank=%d path=%s in %.1f ms",
            name, version, slot, entry.rank, path, (time.perf_counter() - t0) * 1e3,
        )
        return entry

    async def unload(self, name: str) -> AdapterEntry:
        """Stop serving ``name`` now; its slot is freed once in-flight
        requests finish."""
        entry = self.get(name)
        del self._by_name[name]
        entry.state = "draining"
        log.info("adapter unloading: name=%s slot=%d in_flight=%d", name, entry.slot, entry.in_flight)
        if entry.in_flight == 0:
            await self._free(entry)
        else:
            self._draining.add(id(entry))
        return entry

    async def _free(self, entry: AdapterEntry) -> None:
        self._draining.discard(id(entry))
        try:
            await self.backend.clear(entry.slot)
        except Exception:
            # The engine is gone; the slot stays out of use rather than be
            # handed out while it may hold the old weights.
            log.exception("could not clear slot %d of adapter %s", entry.slot, entry.name)
            return
        self._free_slots.append(entry.slot)
        self._free_slots.sort(reverse=True)
        log.info("adapter unloaded: name=%s slot=%d freed", entry.name, entry.slot)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)
