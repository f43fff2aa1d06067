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

What a model id or a path names is mola.lora.catalog (names, adapter
directories, resolvers, paths); a record's lifecycle is mola.lora.records (one
table of transitions); which slot holds what is mola.lora.slots; stacks of
adapters are mola.lora.stacks; leases and the slot backend mola.lora.leases.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..errors import AdapterNotFound, InvalidRequest, ModelNotFound, MolaError
from .catalog import Catalog
from .leases import AdapterRef, Lease, RegistryStats, SlotBackend
from .recipe import Recipe
from .records import AdapterRecord, AdapterState
from .slots import SlotTable
from .sources import AdapterSources
from .stacks import Stacks
from .weights import LoRAWeights

__all__ = ["AdapterRef", "AdapterRegistry", "Lease", "RegistryStats", "SlotBackend"]

log = logging.getLogger("mola.adapters")
S = AdapterState


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
        # What names and paths name; resolvers are asked for unknown ids.
        self.catalog = Catalog(base_id, self.sources, resolvers)
        self.stats = RegistryStats()
        self.slots = SlotTable(max_loras)
        self.stacks = Stacks()
        self._changed = asyncio.Condition()  # a slot freed, a load finished
        self._tasks: set[asyncio.Task] = set()

    # ---- what is known ------------------------------------------------------

    def adapters(self) -> list[AdapterRecord]:
        """Every adapter that can be requested, resident or not."""
        return self.catalog.adapters()

    def compositions(self) -> list[AdapterRecord]:
        """Stacks of adapters built for requests (each one slot when resident)."""
        return list(self.stacks)

    def path_adapters(self) -> list[AdapterRecord]:
        """The current version of each adapter that requests named by path."""
        return list(self.catalog.paths)

    def get(self, name: str) -> AdapterRecord:
        record = self.catalog.get(name)
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
        return self.catalog.register(name, path, source, scale)

    def _is_current(self, record: AdapterRecord) -> bool:
        if record.is_stack:
            return self.stacks.is_current(record)
        return self.catalog.is_current(record)

    # ---- loading ------------------------------------------------------------

    async def load(self, name: str, path: str, scale: float = 1.0, source: str = "rest") -> AdapterRecord:
        """Check the adapter at ``path`` now and serve it as ``name``. It is
        made resident at once when a slot is free or can be freed; otherwise
        it stays known and is loaded on first use."""
        self.catalog.check_name(name)
        real = self.sources.resolve(path)
        weights = await self.backend.read(real)  # raises a 4xx MolaError; nothing changed
        self.catalog.check_name(name)  # another load may have taken the name meanwhile
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
        record = await self.catalog.find(name)
        if record is None:
            raise ModelNotFound(name, param=param)
        return record

    async def _by_path(self, given: str) -> AdapterRecord:
        """The record of the adapter files at ``given`` as they are now (403
        outside the path policy); older versions are retired."""
        record, gone = self.catalog.by_path(given)
        for old in gone:
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
        record = self.catalog.remove(name)
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
