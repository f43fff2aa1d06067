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
- unknown (or unloaded): the resolvers are asked, if any (resolvers.py);
  else ModelNotFound.

A request may also name adapters by path (paths.py): checked by the path
policy, then one record per resolved path and content version.

Unloading stops new leases at once; requests already running finish on the
adapter's weights, then its slot is zeroed and freed. Loading a name again is
a new version with a fresh ``uid``, never served by anything of the old one.

A record's lifecycle is mola.lora.records (one table of transitions); which
slot holds what is mola.lora.slots; stacks of adapters are mola.lora.stacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from ..errors import (AdapterExists, AdapterNotFound, InvalidAdapterName, InvalidRequest, ModelNotFound,
                      MolaError)
from .names import check_adapter_id
from .paths import PathAdapters
from .recipe import Recipe
from .records import AdapterRecord, AdapterState
from .slots import SlotTable
from .sources import AdapterSources, content_version
from .stacks import Stacks
from .weights import LoRAWeights

log = logging.getLogger("mola.adapters")
S = AdapterState


class SlotBackend(Protocol):
    """What the registry needs to move adapters in and out of slots
    (mola.lora.loader.AdapterLoader)."""

    async def read(self, path: str) -> LoRAWeights: ...
    async def build(self, recipe: Recipe) -> LoRAWeights: ...
    async def place(self, slot: int, weights: LoRAWeights, recipe: Recipe) -> None: ...
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
    load_seconds: float = 0.0  # read + write time, summed


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


class AdapterRegistry:
    def __init__(
        self,
        base_id: str,
        backend: SlotBackend,
        max_loras: int,
        sources: AdapterSources | None = None,
        forget: Callable[[list[tuple[str, int]]], Awaitable[Any]] | None = None,
        resolvers: list | None = None,
    ):
        self.base_id = base_id
        self.backend = backend
        # Told the Lease.key's of adapters (and stacks) unloaded, whose
        # cached state (the engine's prompt cache) can go.
        self._forget = forget
        self.max_loras = max_loras
        self.sources = sources or AdapterSources(allow_any_path=True)
        self.stats = RegistryStats()
        self.slots = SlotTable(max_loras)
        self.stacks = Stacks()
        self.paths = PathAdapters()  # adapters named by path in requests
        # Asked, in order, for a model id nothing else knows (resolvers.py).
        self.resolvers = list(resolvers or ())
        self._resolving: dict[str, asyncio.Task] = {}  # id -> the lookup under way
        self._known: dict[str, AdapterRecord] = {}
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
        return list(self.stacks)

    def path_adapters(self) -> list[AdapterRecord]:
        """The current version of each adapter that requests named by path."""
        return list(self.paths)

    def get(self, name: str) -> AdapterRecord:
        record = self._known.get(name) or self._discover(name)
        if record is None:
            raise AdapterNotFound(name)
        return record

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def num_resident(self) -> int:
        return self.slots.num_held

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
        check_adapter_id(name)
        if name == self.base_id or name in self._known:
            raise AdapterExists(name)

    def _discover(self, name: str) -> AdapterRecord | None:
        if name in self._unloaded or name == self.base_id:
            return None
        path = self.sources.discover(name)  # checked; raises AdapterPathNotAllowed
        if path is None:
            return None
        log.info("adapter discovered: name=%s path=%s", name, path)
        return self.register(name, path, "dir")

    def _is_current(self, record: AdapterRecord) -> bool:
        if record.is_stack:
            return self.stacks.is_current(record)
        if record.source == "request":
            return self.paths.is_current(record)
        return self._known.get(record.name) is record

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
        slot = self._take_slot()
        if slot is not None:
            record.move_to(S.LOADING)
            try:
                await self._install(record, slot, weights)
            except BaseException:
                self._loading_failed(record, None)
                raise
        return record

    async def acquire(
        self,
        model_id: str,
        lora_scale: float | None = None,
        stack: list[AdapterRef | tuple[str, float]] | None = None,
    ) -> Lease:
        """A lease on the base model, an adapter, or adapters stacked together,
        loading just in time.

        ``lora_scale`` multiplies the adapter ``model_id`` names, for this
        request only (the row's scale: rows with different scales of one
        adapter share its slot). ``stack`` lists adapters (AdapterRef: by name
        or by path, with a scale; or (name, scale) pairs) applied together
        with it: their sum is one LoRA whose A is the parts' A side by side
        and whose B is their scaled B stacked, built once into a slot of its
        own, cached by its parts and evicted like any adapter.
        """
        is_base = model_id == self.base_id
        if is_base and lora_scale is not None:
            raise InvalidRequest(
                f"lora_scale scales an adapter, but '{model_id}' is the base model.", param="lora_scale"
            )
        head = None if is_base else await self._lookup(model_id, "model")
        if not stack:
            if head is None:
                return Lease(self, None)
            return await self._lease(head, 1.0 if lora_scale is None else lora_scale)
        parts = [] if head is None else [(head, 1.0 if lora_scale is None else lora_scale)]
        for entry in stack:
            ref = entry if isinstance(entry, AdapterRef) else AdapterRef(name=entry[0], scale=entry[1])
            if ref.path is not None:
                record = await self._by_path(ref.path)
            else:
                record = await self._lookup(ref.name, "adapters")
            parts.append((record, ref.scale))
        if len({id(r) for r, _ in parts}) < len(parts):
            raise InvalidRequest("An adapter is named more than once in 'adapters'.", param="adapters")
        if len(parts) == 1:
            return await self._lease(parts[0][0], parts[0][1])
        return await self._lease(self.stacks.get_or_make(parts), 1.0)

    async def _lookup(self, name: str, param: str) -> AdapterRecord:
        record = self._known.get(name) or self._discover(name)
        if record is None and self.resolvers:
            record = await self._resolve(name)
        if record is None:
            raise ModelNotFound(name, param=param)
        return record

    async def _resolve(self, name: str) -> AdapterRecord | None:
        """Ask the resolvers for an id nothing else knows; one lookup per id
        at a time, shared by the requests that ask meanwhile."""
        if name in self._unloaded or name == self.base_id:
            return None
        try:
            check_adapter_id(name)
        except InvalidAdapterName:
            return None
        task = self._resolving.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._ask_resolvers(name))
            self._resolving[name] = task
            task.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(task)  # a request that goes away does not stop it

    async def _ask_resolvers(self, name: str) -> AdapterRecord | None:
        for resolver in self.resolvers:
            path = await resolver.find(name)  # may raise AdapterPathNotAllowed
            if path is None:
                continue
            if name in self._known or name in self._unloaded:  # loaded or unloaded meanwhile
                return self._known.get(name)
            log.info("adapter resolved: name=%s resolver=%s path=%s", name, resolver.kind, path)
            return self.register(name, path, f"resolver:{resolver.kind}")
        return None

    async def _by_path(self, given: str) -> AdapterRecord:
        """The record of the adapter files at ``given`` as they are now: the
        path policy first (403 outside it), then one record per resolved path
        and content version; an older version is retired."""
        real = self.sources.resolve_request_path(given)
        record, stale = self.paths.get_or_make(real, content_version(real))
        if stale is not None:
            log.info("adapter changed on disk: name=%s version=%d -> %d", record.name, stale.version,
                     record.version)
            await self._retire_all(stale)
        for old in self.paths.surplus():
            self.paths.drop(old)
            await self._retire_all(old)
        return record

    async def _lease(self, record: AdapterRecord, row_scale: float) -> Lease:
        record.waiting += 1
        try:
            while True:
                if not self._is_current(record):
                    raise ModelNotFound(record.name)  # unloaded while we waited
                if record.state is S.RESIDENT:
                    record.in_flight += 1
                    record.touch()
                    return Lease(self, record, row_scale)
                if record.state is S.LOADING:
                    await record.loaded.wait()
                    if record.load_error is not None:
                        raise record.load_error
                    continue
                await self._load_resident(record)
        finally:
            record.waiting -= 1

    async def _load_resident(self, record: AdapterRecord) -> None:
        """Make a known record resident: read it, wait for a slot, write it."""
        record.move_to(S.LOADING)
        record.loaded, record.load_error = asyncio.Event(), None
        slot = None
        try:
            t0 = time.perf_counter()
            weights = await self.backend.build(self._recipe(record))
            self._note_weights(record, weights)
            slot = self._take_slot()
            while slot is None:
                async with self._changed:
                    await self._changed.wait()
                if not self._is_current(record):
                    raise ModelNotFound(record.name)
                slot = self._take_slot()
            await self._install(record, slot, weights, t0)
        except BaseException as e:
            self._loading_failed(record, e)
            raise

    def _loading_failed(self, record: AdapterRecord, error: BaseException | None) -> None:
        if record.state is S.LOADING:
            record.move_to(S.KNOWN if self._is_current(record) else S.REMOVED)
        if isinstance(error, MolaError):
            record.load_error = error
            self.stats.load_failures += 1
        record.loaded.set()

    def _take_slot(self) -> int | None:
        """A reserved slot: a free one, or the least recently used idle
        resident's (evicting it); None if every slot is busy."""
        taken = self.slots.reserve()
        if taken is None:
            return None
        slot, victim = taken
        if victim is not None:
            victim.slot = None
            if victim.is_stack:  # a stack is rebuilt when asked for again
                victim.move_to(S.REMOVED)
                self.stacks.drop(victim)
            else:
                victim.move_to(S.KNOWN)
            self.stats.evictions += 1
            log.info("adapter evicted: name=%s slot=%d (least recently used)", victim.name, slot)
        return slot

    async def _install(self, record: AdapterRecord, slot: int, weights: LoRAWeights,
                       t0: float | None = None) -> None:
        """Write a LOADING record's weights into its reserved slot."""
        t0 = time.perf_counter() if t0 is None else t0
        try:
            await self.backend.place(slot, weights, self._recipe(record))
        except BaseException:
            self.slots.free(slot)
            await self._notify()
            raise
        if not self._is_current(record):  # unloaded while loading
            self._spawn(self._clear(slot))
            raise ModelNotFound(record.name)
        self.slots.hold(slot, record)
        record.slot = slot
        record.move_to(S.RESIDENT)
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
        """What the record's slot holds: a stack's parts (their scales already
        multiplied in), or one adapter at its default strength."""
        if record.is_stack:
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
            if record.state is S.DRAINING:
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
        await self._retire_all(record)
        return record

    async def _retire_all(self, record: AdapterRecord) -> None:
        """A record no longer current, with the stacks built from it: drained
        if resident, and their cached prompts dropped."""
        stacks = self.stacks.using(record)
        for stack in stacks:
            self.stacks.drop(stack)
            await self._retire(stack)
        log.info("adapter unloading: name=%s version=%d slot=%s in_flight=%d", record.name,
                 record.version, record.slot, record.in_flight)
        await self._retire(record)
        await self._notify()
        await self._forget_cached([record, *stacks])

    async def _forget_cached(self, records: list[AdapterRecord]) -> None:
        if self._forget is None:
            return
        try:
            await self._forget([(r.name, r.version) for r in records])
        except Exception:  # the engine is gone, and its cache with it
            log.exception("could not drop the cached prompts of %s", records[0].name)

    async def _retire(self, record: AdapterRecord) -> None:
        """A record no longer current: drain it if resident."""
        if record.state is S.RESIDENT:
            record.move_to(S.DRAINING)
            if record.in_flight == 0:
                await self._free(record)
        elif record.state is S.KNOWN:
            record.move_to(S.REMOVED)
        # LOADING: the load notices that the record is no longer current and
        # gives its slot back; DRAINING or REMOVED: nothing more to do.

    async def _free(self, record: AdapterRecord) -> None:
        """A drained record leaves its slot, which is zeroed and freed."""
        slot = record.slot
        record.slot = None
        record.move_to(S.REMOVED)
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
            self.slots.put_out_of_use(slot)
            return
        self.slots.free(slot)
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
