"""Model id -> slot: which adapters are known, which are resident, who uses them.
Plain Python on the event loop; nothing here touches an array.

The registry knows every adapter it may serve (named at start, found in an
adapter directory, loaded or pushed over REST) and keeps at most
``max_loras`` of them resident in slots. A request takes a :class:`Lease` on
the model id it names: resident, at once; known, loaded just in time into a
free slot or that of the least recently used idle adapter, or it waits (never
fails) while every slot runs requests, its adapter prefetched on the reader
thread unless the host tier holds it (host_tier.py), slots going to waiting
adapters fairly (admission.py); unknown, the resolvers are asked
(resolvers.py), else ModelNotFound. Adapters named by path (paths.py) get a
record per resolved path and content version.

A slot write is queued on the engine ahead of every request that can use the
slot, so a load never waits for the engine's next step. Unloading stops new
leases at once; requests already running finish on the adapter's weights,
then its slot is zeroed and freed (residency.py). Loading a name again is a
new version with a fresh ``uid``, never served by anything of the old one.
The package's map is mola.registry's doc.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Awaitable, Callable

from ..adapters.dora import check_row_scale
from ..adapters.loader import AdapterLoader, PreparedAdapter
from ..adapters.weights import LoRAWeights
from ..adapters.recipe import SlotRecipe
from ..errors import AdapterNotFound, InvalidRequest, ModelNotFound
from .catalog import AdapterRef, Catalog
from .names import check_adapter_id
from .host_tier import HostTier
from .records import AdapterRecord, AdapterState
from .residency import Residency
from .sources import AdapterSources
from .stacks import Stacks
from .waiters import Waiters

log = logging.getLogger("mola.adapters")
S = AdapterState


class Lease:
    """A request's hold on a model id. ``release`` is idempotent."""

    def __init__(self, residency: Residency, record: AdapterRecord | None, row_scale: float = 1.0):
        self._residency = residency
        self.record = record  # None: the base model
        self.slot = record.slot if record else 0
        self.row_scale = row_scale  # this request's multiplier of the slot's delta (its lora_scale)
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
            if self.record is not None:
                self._residency.release(self.record)


class AdapterRegistry:
    def __init__(
        self,
        base_id: str,
        loader: AdapterLoader,  # reads adapters; its port (the engine's slots) takes the writes
        max_loras: int,
        sources: AdapterSources | None = None,
        forget: Callable[[list[tuple[str, int]]], Awaitable[Any]] | None = None,
        resolvers: list | None = None,
        tier: HostTier | None = None,
        max_wait: float = math.inf,
        expert_slots: int = 0,  # slots 1..expert_slots carry expert LoRA (mixtures of experts)
    ):
        self.base_id = base_id
        self.loader = loader
        self._forget = forget  # told the Lease.key's of adapters unloaded: their cached prompts can go
        self._retiring: set[asyncio.Task] = set()  # versions replaced by a push, draining
        self.max_loras = max_loras
        self.sources = sources or AdapterSources(allow_any_path=True)
        self.catalog = Catalog(base_id, self.sources, resolvers)  # names, paths; resolvers for unknown ids
        self.stacks = Stacks(self.catalog.uids)
        self.tier = tier if tier is not None else HostTier()  # off unless given limits
        self.waiters = Waiters(max_wait, max_yielding=max(1, max_loras // 4))  # who waits for a slot, admission
        self.queue = self.waiters.queue  # who waits for a slot (admission)
        # Which records are in slots, and how they get there and leave.
        self.residency = Residency(loader, loader.port, max_loras, self.tier, self.stacks, self.waiters,
                                   expert_slots)
        self.slots = self.residency.slots
        self.stats = self.residency.stats

    # ---- what is known ------------------------------------------------------

    def adapters(self) -> list[AdapterRecord]:
        """Every adapter that can be requested, resident or not."""
        return self.catalog.adapters()

    def stack_adapters(self) -> list[AdapterRecord]:
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

    def describe_admission(self) -> dict:
        """Requests waiting for a slot, and how admission has gone."""
        return self.waiters.describe(self.slots.holders())

    def register(self, name: str, path: str, source: str, slot_scale: float = 1.0) -> AdapterRecord:
        """Know ``name`` as the adapter at (already resolved) ``path``."""
        return self.catalog.register(name, path, source, slot_scale)

    def _is_current(self, record: AdapterRecord) -> bool:
        if record.is_stack:
            return self.stacks.is_current(record)
        return self.catalog.is_current(record)

    # ---- loading ------------------------------------------------------------

    async def load(self, name: str, path: str, slot_scale: float = 1.0, source: str = "rest",
                   prepared: PreparedAdapter | None = None) -> AdapterRecord:
        """Check the adapter at ``path`` now and serve it as ``name``, its delta times ``slot_scale``
        (POST /v1/adapters' "scale"): resident at once if a slot is free or can be freed and no
        request waits, else known (in the host tier) and loaded on first use. ``source`` "push":
        ``path`` names factors held in memory (mola.adapters.pushed), a new version of ``name``
        swapped in at once (requests in flight finish on the old one, whose cached prompts go).
        ``prepared``: ``path`` read and made into slot rows already, at ``slot_scale`` (a push
        does it on the reader thread in the same hop as its parse)."""
        pushed = source == "push"
        (check_adapter_id if pushed else self.catalog.check_name)(name)
        real, t0 = path if pushed else self.sources.resolve(path), time.monotonic()
        self.tier.stats.reads += 1
        if prepared is None:  # a 4xx MolaError: nothing changed
            prepared = await self.loader.prepare(SlotRecipe.single(real, slot_scale))
        if (old := self.catalog.get(name) if pushed else None) is not None:
            self.catalog.remove(name)
        self.catalog.check_name(name)  # another load may have taken the name meanwhile
        record = self.register(name, real, source, slot_scale)
        self.residency.note_weights(record, prepared)
        # Waiting requests come first.
        slot = None if len(self.queue) else self.residency.take_slot(prepared.rows.has_experts)
        if slot is not None:
            self.residency.place(record, slot, prepared, t0)
        self.tier.put(record, prepared)
        if old is not None:  # drained and its cached prompts dropped without holding up the push
            self.loader.pushed.drop(old.path)  # (the new version's key is new: the old one's KV never serves it)
            task = asyncio.get_running_loop().create_task(self._retire_all(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return record

    async def push(self, name: str, weights: LoRAWeights, slot_scale: float,
                   prepared: PreparedAdapter) -> AdapterRecord:
        """Serve factors pushed from memory (``prepared`` from them already) as
        a new version of ``name``: held by the loader's PushedAdapters until
        that version is replaced or unloaded, or the base closes."""
        source = self.loader.pushed.keep(name, weights)
        try:
            return await self.load(name, source, slot_scale, source="push", prepared=prepared)
        except BaseException:
            self.loader.pushed.drop(source)
            raise

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
                return Lease(self.residency, None)
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
        ticket = None
        try:
            while True:
                if not self._is_current(record):
                    raise ModelNotFound(record.name)  # unloaded while we waited
                if record.state is S.RESIDENT:
                    check_row_scale(record.kind, row_scale, record.name)  # DoRA: lora_scale 1 only
                    record.in_flight += 1
                    record.touch()
                    if ticket is None:
                        self.stats.leases_resident += 1
                    else:
                        self.stats.leases_loaded += 1
                    return Lease(self.residency, record, row_scale)
                if ticket is None:  # wait in line (admission) for a slot
                    ticket = self.queue.join(record, time.monotonic())
                woken = self.waiters.future(record)
                self.waiters.admit(self.residency)
                await asyncio.shield(woken)  # raises the error of a failed read
        finally:
            record.waiting -= 1
            if ticket is not None:
                self.queue.leave(record, ticket)
                self._after_wait(record)

    def _after_wait(self, record: AdapterRecord) -> None:
        """A request stopped waiting for ``record``."""
        if record.waiting == 0 and record.is_stack and record.state is S.KNOWN:
            self.residency.drop_stack(record)  # a stack evicted while requested: nobody wants it now
        self.tier.settle()
        self.waiters.admit(self.residency)

    # ---- unloading -------------------------------------------------------------

    async def unload(self, name: str) -> AdapterRecord:
        """Stop serving ``name`` now; its slot frees when in-flight requests end."""
        record = self.catalog.remove(name)
        self.stats.unloads += 1
        await self._retire_all(record)
        self.loader.pushed.drop(record.path)  # (a pushed adapter's factors; nothing for a file's)
        return record

    async def _retire_all(self, record: AdapterRecord) -> None:
        """A record no longer current, with the stacks built from it: drained
        if resident, and their cached prompts dropped."""
        stacks = self.stacks.using(record)
        for stack in stacks:
            self.stacks.drop(stack)
            await self.residency.retire(stack)
        log.info("adapter unloading: name=%s version=%d slot=%s in_flight=%d", record.name,
                 record.version, record.slot, record.in_flight)
        await self.residency.retire(record)
        self.waiters.admit(self.residency)
        await self._forget_cached([record, *stacks])

    async def _forget_cached(self, records: list[AdapterRecord]) -> None:
        if self._forget is None:
            return
        try:
            await self._forget([(r.name, r.version) for r in records])
        except Exception:  # the engine is gone, and its cache with it
            log.exception("could not drop the cached prompts of %s", records[0].name)

    def close(self) -> None:
        """Stop reads and timers (the server is shutting down)."""
        self.tier.cancel_reads()
        self.waiters.close()
