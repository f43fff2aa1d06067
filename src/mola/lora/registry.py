"""Model id -> slot: which adapters are known, which are resident, who uses them.

Plain Python on the event loop; nothing here touches an array.

The registry knows every adapter it may serve (named at start, found in an
adapter directory, loaded over REST) and keeps at most ``max_loras`` of them
resident in slots. A request takes a :class:`Lease` on the model id it names:

- resident: the lease is immediate;
- known but not resident: it is loaded just in time into a free slot, or into
  the slot of the least recently used adapter that no request is using; when
  every slot is busy with running requests the request waits, it does not
  fail;
- unknown (or unloaded): ModelNotFound.

Unloading stops new leases at once; requests already running finish on the
adapter's weights, then its slot is zeroed and freed. Loading a name again is
a new version with a fresh ``uid``, never served by anything of the old one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import AdapterExists, AdapterNotFound, InvalidRequest, ModelNotFound, MolaError
from .recipe import Recipe
from .sources import AdapterSources
from .weights import LoRAWeights

log = logging.getLogger("mola.adapters")

_uids = itertools.count(1)


class SlotBackend(Protocol):
    """What the registry needs to move adapters in and out of slots
    (mola.lora.loader.AdapterLoader)."""

    async def read(self, path: str) -> LoRAWeights: ...
    async def build(self, recipe: Recipe) -> LoRAWeights: ...
    async def place(self, slot: int, weights: LoRAWeights, recipe: Recipe) -> None: ...
    async def remove(self, slot: int) -> None: ...


@dataclass
class RegistryStats:
    loads: int = 0  # adapters written into a slot
    load_failures: int = 0
    evictions: int = 0  # residents moved out to make room
    unloads: int = 0
    load_seconds: float = 0.0  # read + write time, summed


@dataclass(eq=False)
class AdapterRecord:
    """One version of one adapter name."""

    name: str
    path: str  # resolved path (or hub snapshot); `root` in /v1/models
    source: str  # "cli", "config", "dir", "rest"
    version: int
    scale: float = 1.0  # default multiplier of the adapter's own scale
    uid: int = field(default_factory=lambda: next(_uids))  # unique per version
    created: int = field(default_factory=lambda: int(time.time()))
    state: str = "known"  # known -> loading -> resident (-> known on eviction); draining; removed
    slot: int | None = None
    in_flight: int = 0  # leases held by requests
    waiting: int = 0  # requests waiting for it to become resident
    last_used: float | None = None
    loads: int = 0
    rank: int | None = None  # known once read
    adapter_scale: float | None = None
    format: str | None = None
    nbytes: int | None = None
    loaded: asyncio.Event = field(default_factory=asyncio.Event)  # set when leaving "loading"
    load_error: MolaError | None = None
    # A composition (several adapters stacked into one slot): (path, scale)
    # of each part, and the part records it was built from.
    parts: tuple[tuple[str, float], ...] | None = None
    part_records: tuple["AdapterRecord", ...] = ()

    @property
    def resident(self) -> bool:
        return self.state in ("resident", "draining") and self.slot is not None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "composition": None if self.parts is None else [
                {"name": r.name, "version": r.version, "scale": sc}
                for r, (_, sc) in zip(self.part_records, self.parts)
            ],
            "path": self.path,
            "source": self.source,
            "format": self.format,
            "state": self.state,
            "resident": self.resident,
            "slot": self.slot,
            "version": self.version,
            "rank": self.rank,
            "scale": self.adapter_scale,
            "default_request_scale": self.scale,
            "nbytes": self.nbytes,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "loads": self.loads,
            "created": self.created,
            "last_used": self.last_used,
        }


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
        """What a cache keyed by adapter contents uses: (name, uid)."""
        return ("", 0) if self.record is None else (self.record.name, self.record.uid)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self)


class AdapterRegistry:
    def __init__(
        self,
        base_id: str,
        backend: SlotBackend,
        max_loras: int,
        sources: AdapterSources | None = None,
    ):
        self.base_id = base_id
        self.backend = backend
        self.max_loras = max_loras
        self.sources = sources or AdapterSources(allow_any_path=True)
        self.stats = RegistryStats()
        self._known: dict[str, AdapterRecord] = {}
        self._compositions: dict[str, AdapterRecord] = {}  # stacked adapters, by key
        self._slots: dict[int, AdapterRecord | None] = {s: None for s in range(1, max_loras + 1)}
        self._unloaded: set[str] = set()  # names not to rediscover in adapter dirs
        self._versions: dict[str, int] = {}
        self._changed = asyncio.Condition()  # a slot freed, a load finished
        self._tasks: set[asyncio.Task] = set()

    # ---- what is known ------------------------------------------------------

    def adapters(self) -> list[AdapterRecord]:
        """Every adapter that can be requested, resident or not."""
        return list(self._known.values())

    def compositions(self) -> list[AdapterRecord]:
        """Stacks of adapters built for requests (each one slot when resident)."""
        return list(self._compositions.values())

    def get(self, name: str) -> AdapterRecord:
        record = self._known.get(name) or self._discover(name)
        if record is None:
            raise AdapterNotFound(name)
        return record

    @property
    def num_free_slots(self) -> int:
        return sum(r is None for r in self._slots.values())

    @property
    def num_resident(self) -> int:
        return sum(r is not None for r in self._slots.values())

    def register(self, name: str, path: str, source: str, scale: float = 1.0) -> AdapterRecord:
        """Know ``name`` as the adapter at (already resolved) ``path``."""
        self._check_name(name)
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        record = AdapterRecord(name=name, path=str(path), source=source, version=version, scale=scale)
        self._known[name] = record
        self._unloaded.discard(name)
        return record

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name.strip() or name != name.strip() or len(name) > 256:
            raise InvalidRequest(
                f"Invalid adapter name {name!r}: 1-256 characters without surrounding spaces.",
                param="name",
            )
        if name == self.base_id or name in self._known:
            raise AdapterExists(name)

    def _discover(self, name: str) -> AdapterRecord | None:
        if name in self._unloaded or name == self.base_id:
            return None
        path = self.sources.discover(name)
        if path is None:
            return None
        log.info("adapter discovered: name=%s path=%s", name, path)
        return self.register(name, str(path.resolve()), "dir")

    # ---- loading ------------------------------------------------------------

    async def load(self, name: str, path: str, scale: float = 1.0, source: str = "rest") -> AdapterRecord:
        """Check the adapter at ``path`` now and serve it as ``name``. It is
        made resident at once when a slot is free or can be freed; otherwise
        it stays known and is loaded on first use."""
        self._check_name(name)
        real = self.sources.resolve(path)
        weights = await self.backend.read(real)  # raises a 4xx MolaError; nothing changed
        self._check_name(name)  # another load may have taken the name meanwhile
        record = self.register(name, real, source, scale)
        self._note_weights(record, weights)
        slot = self._take_slot(wait_ok=False)
        if slot is not None:
            await self._install(record, slot, weights)
        return record

    async def acquire(
        self,
        model_id: str,
        lora_scale: float | None = None,
        stack: list[tuple[str, float]] | None = None,
    ) -> Lease:
        """A lease on the base model, an adapter, or adapters stacked together,
        loading just in time.

        ``lora_scale`` multiplies the adapter ``model_id`` names, for this
        request only (the row's scale: rows with different scales of one
        adapter share its slot). ``stack`` lists (adapter, scale) pairs applied
        together with it: their sum is one LoRA whose A is the parts' A side by
        side and whose B is their scaled B stacked, built once into a slot of
        its own, cached by its parts and evicted like any adapter.
        """
        is_base = model_id == self.base_id
        if is_base and lora_scale is not None:
            raise InvalidRequest(
                f"lora_scale scales an adapter, but '{model_id}' is the base model.", param="lora_scale"
            )
        head = None if is_base else self._lookup(model_id, "model")
        if not stack:
            if head is None:
                return Lease(self, None)
            return await self._lease(head, 1.0 if lora_scale is None else lora_scale)
        parts = [] if head is None else [(head, 1.0 if lora_scale is None else lora_scale)]
        for name, scale in stack:
            parts.append((self._lookup(name, "adapters"), scale))
        names = [r.name for r, _ in parts]
        if len(set(names)) < len(names):
            raise InvalidRequest("An adapter is named more than once in 'adapters'.", param="adapters")
        if len(parts) == 1:
            return await self._lease(parts[0][0], parts[0][1])
        return await self._lease(self._composition(parts), 1.0)

    def _lookup(self, name: str, param: str) -> AdapterRecord:
        record = self._known.get(name) or self._discover(name)
        if record is None:
            raise ModelNotFound(name, param=param)
        return record

    def _composition(self, parts: list[tuple[AdapterRecord, float]]) -> AdapterRecord:
        parts = sorted(parts, key=lambda p: p[0].name)  # a sum: order does not matter
        key = "+".join(f"{r.name}@v{r.version}*{scale:g}" for r, scale in parts)
        record = self._compositions.get(key)
        if record is None:
            record = AdapterRecord(
                name=key, path=" + ".join(r.path for r, _ in parts), source="composition", version=1,
                parts=tuple((r.path, r.scale * scale) for r, scale in parts),
                part_records=tuple(r for r, _ in parts),
            )
            self._compositions[key] = record
        return record

    def _is_current(self, record: AdapterRecord) -> bool:
        table = self._compositions if record.parts is not None else self._known
        return table.get(record.name) is record

    async def _lease(self, record: AdapterRecord, row_scale: float) -> Lease:
        record.waiting += 1
        try:
            while True:
                if not self._is_current(record):
                    raise ModelNotFound(record.name)  # unloaded while we waited
                if record.state == "resident":
                    record.in_flight += 1
                    record.last_used = time.time()
                    for part in record.part_records:
                        part.last_used = record.last_used
                    return Lease(self, record, row_scale)
                if record.state == "loading":
                    await record.loaded.wait()
                    if record.load_error is not None:
                        raise record.load_error
                    continue
                await self._load_resident(record)
        finally:
            record.waiting -= 1

    async def _load_resident(self, record: AdapterRecord) -> None:
        """Make a known record resident (called with state "known")."""
        record.state, record.loaded, record.load_error = "loading", asyncio.Event(), None
        try:
            t0 = time.perf_counter()
            weights = await self.backend.build(self._recipe(record))
            self._note_weights(record, weights)
            slot = self._take_slot(wait_ok=True)
            while slot is None:
                async with self._changed:
                    await self._changed.wait()
                if not self._is_current(record):
                    raise ModelNotFound(record.name)
                slot = self._take_slot(wait_ok=True)
            await self._install(record, slot, weights, t0)
        except BaseException as e:
            if record.state == "loading":
                record.state = "known"
            if isinstance(e, MolaError):
                record.load_error = e
                self.stats.load_failures += 1
            record.loaded.set()
            raise

    def _take_slot(self, wait_ok: bool) -> int | None:
        """A free slot, or the slot of the least recently used resident that no
        request uses (evicting it); None if every slot is busy."""
        for slot, holder in self._slots.items():
            if holder is None:
                self._slots[slot] = _RESERVED
                return slot
        idle = [r for r in self._slots.values() if r is not _RESERVED and r.state == "resident"
                and r.in_flight == 0 and r.waiting == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda r: (r.last_used or 0.0, r.uid))
        slot = victim.slot
        victim.state, victim.slot = "known", None
        if victim.parts is not None:  # a composition is rebuilt when asked for again
            victim.state = "removed"
            self._compositions.pop(victim.name, None)
        self._slots[slot] = _RESERVED
        self.stats.evictions += 1
        log.info("adapter evicted: name=%s slot=%d (least recently used)", victim.name, slot)
        return slot

    async def _install(self, record: AdapterRecord, slot: int, weights: LoRAWeights,
                       t0: float | None = None) -> None:
        t0 = time.perf_counter() if t0 is None else t0
        try:
            await self.backend.place(slot, weights, self._recipe(record))
        except BaseException:
            self._slots[slot] = None
            await self._notify()
            raise
        if not self._is_current(record):  # unloaded while loading
            self._slots[slot] = None
            self._spawn(self._clear(slot))
            raise ModelNotFound(record.name)
        self._slots[slot] = record
        record.slot, record.state = slot, "resident"
        record.loads += 1
        record.loaded.set()
        seconds = time.perf_counter() - t0
        self.stats.loads += 1
        self.stats.load_seconds += seconds
        log.info("adapter loaded: name=%s version=%d slot=%d rank=%s path=%s in %.1f ms",
                 record.name, record.version, slot, record.rank, record.path, seconds * 1e3)
        await self._notify()

    @staticmethod
    def _recipe(record: AdapterRecord) -> Recipe:
        """What the record's slot holds: a composition's parts (their scales
        already multiplied in), or one adapter at its default strength."""
        if record.parts is not None:
            return Recipe(record.parts, 1.0)
        return Recipe.single(record.path, record.scale)

    @staticmethod
    def _note_weights(record: AdapterRecord, weights: LoRAWeights) -> None:
        record.rank, record.adapter_scale = weights.rank, weights.scale
        record.format, record.nbytes = weights.format, weights.nbytes

    # ---- releasing and unloading ----------------------------------------------

    def _release(self, lease: Lease) -> None:
        record = lease.record
        if record is None:
            return
        record.in_flight -= 1
        if record.in_flight == 0:
            if record.state == "draining":
                self._spawn(self._free(record))
            else:
                self._spawn(self._notify())  # an idle resident can be evicted now

    async def unload(self, name: str) -> AdapterRecord:
        """Stop serving ``name`` now; its slot frees when in-flight requests end."""
        record = self._known.get(name)
        if record is None:
            raise AdapterNotFound(name)
        del self._known[name]
        self._unloaded.add(name)
        self.stats.unloads += 1
        for key, comp in list(self._compositions.items()):
            if record in comp.part_records:
                del self._compositions[key]
                await self._retire(comp)
        log.info("adapter unloading: name=%s slot=%s in_flight=%d", name, record.slot, record.in_flight)
        await self._retire(record)
        await self._notify()
        return record

    async def _retire(self, record: AdapterRecord) -> None:
        """A record no longer current: drain it if resident."""
        if record.state == "resident":
            record.state = "draining"
            if record.in_flight == 0:
                await self._free(record)
        elif record.state != "draining":
            record.state = "removed"  # a load in progress notices and gives its slot back

    async def _free(self, record: AdapterRecord) -> None:
        slot = record.slot
        record.state, record.slot = "removed", None
        if slot is None:
            return
        await self._clear(slot)
        log.info("adapter unloaded: name=%s slot=%d freed", record.name, slot)

    async def _clear(self, slot: int) -> None:
        try:
            await self.backend.remove(slot)
        except Exception:
            # The engine is gone: keep the slot out of use rather than hand
            # it out while it may hold old weights.
            log.exception("could not clear slot %d", slot)
            self._slots[slot] = _RESERVED
            return
        self._slots[slot] = None
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _Reserved:
    """Placeholder in a slot being loaded."""

    state = "reserved"
    in_flight = 1
    slot = None


_RESERVED = _Reserved()
