"""What the registry hands out and needs: a request's Lease on a model id,
the entries of a request's ``adapters`` (AdapterRef), the slot backend it
drives (SlotBackend) and its counters (RegistryStats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Protocol

from .loader import PreparedAdapter
from .pack import SlotRows
from .recipe import Recipe
from .records import AdapterRecord

if TYPE_CHECKING:
    from .registry import AdapterRegistry


class SlotBackend(Protocol):
    """What the registry needs to move adapters in and out of slots
    (mola.lora.loader.AdapterLoader)."""

    async def prepare(self, recipe: Recipe) -> PreparedAdapter: ...
    def write(self, slot: int, rows: SlotRows, recipe: Recipe) -> Awaitable[None]: ...
    async def remove(self, slot: int) -> None: ...


@dataclass(frozen=True)
class AdapterRef:
    """One entry of a request's ``adapters``: a known adapter by ``name``, or
    the adapter files at ``path``, applied with ``scale``."""

    name: str | None = None
    path: str | None = None
    scale: float = 1.0


@dataclass
class RegistryStats:
    loads: int = 0  # adapters written into a slot
    load_failures: int = 0
    evictions: int = 0  # residents moved out to make room
    unloads: int = 0
    load_seconds: float = 0.0  # from the need (a request, a POST) to resident, summed
    leases_resident: int = 0  # requests whose adapter was in a slot already (slot hits)
    leases_loaded: int = 0  # requests that waited for their adapter's load


class Lease:
    """A request's hold on a model id. ``release`` is idempotent."""

    def __init__(self, registry: "AdapterRegistry", record: AdapterRecord | None,
                 row_scale: float = 1.0):
        self._registry = registry
        self.record = record  # None: the base model
        self.slot = record.slot if record else 0
        self.row_scale = row_scale  # this request's multiplier of the slot's delta
        self._released = False

    @property
    def key(self) -> tuple[str, int]:
        """What the slot holds, for a cache keyed by adapter contents (the
        prompt cache): ("", 0) for the base model, else (name, version). A
        name's versions never repeat, so a reloaded adapter has a new key; a
        stack's name spells its parts' names, versions and scales, so a stack
        rebuilt after an eviction keeps its key."""
        return ("", 0) if self.record is None else (self.record.name, self.record.version)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self)
