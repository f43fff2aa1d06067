"""Moving records in and out of adapter slots, for the registry: reserving a
slot (evicting the least recently used idle resident), queueing the slot
write, prefetching rows into the host tier, making residents yield, and
zeroing and freeing a drained record's slot. It is what admission drives
(mola.lora.admission.SlotControl). Plain Python on the event loop; the
arrays are the engine's, reached through the slot backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from .admission import AdmissionQueue
from .host_tier import HostTier
from .leases import RegistryStats, SlotBackend
from .loader import PreparedAdapter
from .recipe import Recipe
from .records import AdapterRecord, AdapterState
from .slots import SlotTable
from .stacks import Stacks

log = logging.getLogger("mola.adapters")
S = AdapterState


def recipe_of(record: AdapterRecord) -> Recipe:
    """What the record's slot holds: a stack's parts (their scales already
    multiplied in), or one adapter at its default strength."""
    if record.is_stack:
        return Recipe(record.parts, 1.0)
    return Recipe.single(record.path, record.scale)


class Residency:
    def __init__(self, backend: SlotBackend, max_loras: int, tier: HostTier, stacks: Stacks,
                 stats: RegistryStats, queue: AdmissionQueue,
                 wake: Callable[..., None], admit: Callable[[], None], expert_slots: int = 0):
        self.backend = backend
        self.slots = SlotTable(max_loras, expert_slots)
        self.tier = tier
        self.stats = stats
        self._stacks = stacks
        self._queue = queue
        self._wake = wake  # wake(record, error=None): the registry's waiters for ``record``
        self._admit = admit  # run admission again (a slot freed, a read finished)

    def has_rows(self, record: AdapterRecord) -> bool:
        return record in self.tier

    def prefetch(self, record: AdapterRecord) -> None:
        async def read() -> PreparedAdapter:
            prepared = await self.backend.prepare(recipe_of(record))
            self.note_weights(record, prepared)
            return prepared

        self.tier.prefetch(record, read, self._read_done)

    def _read_done(self, record: AdapterRecord, error: BaseException | None) -> None:
        if error is not None:  # every request waiting for it now gets the error, nobody else
            self.stats.load_failures += 1
            self._queue.discard(record)
            self._wake(record, error)
            log.info("adapter read failed: name=%s: %s", record.name, error)
        self._admit()

    def install(self, record: AdapterRecord, slot: int) -> None:
        prepared = self.tier.take(record)
        try:
            self.place(record, slot, prepared, self._queue.since(record))
        except Exception as e:  # the engine is gone: its waiters hear it
            self._queue.discard(record)
            self._wake(record, e)

    def residents(self) -> list[AdapterRecord]:
        return self.slots.holders()

    def set_yielding(self, record: AdapterRecord, yielding: bool) -> None:
        record.move_to(S.YIELDING if yielding else S.RESIDENT)
        if yielding:
            log.info("adapter yielding: name=%s slot=%d in_flight=%d (a request waited %.1f s for a slot)",
                     record.name, record.slot, record.in_flight, self._queue.max_wait)
        else:
            self._wake(record)  # its waiters take leases again

    def needs_experts(self, record: AdapterRecord) -> bool:
        """Its rows (read already) carry expert LoRA: it needs an expert slot."""
        prepared = self.tier.peek(record)
        return prepared is not None and prepared.rows.has_experts

    def slot_for(self, record: AdapterRecord) -> int | None:
        """take_slot for a record whose rows are read."""
        return self.take_slot(self.needs_experts(record))

    def can_serve(self, resident: AdapterRecord, record: AdapterRecord) -> bool:
        """Would ``resident``'s slot carry ``record``?"""
        return resident.slot is not None and self.slots.can_carry(resident.slot, self.needs_experts(record))

    def take_slot(self, needs_experts: bool = False) -> int | None:
        """A reserved slot (an expert slot if ``needs_experts``): a free one,
        or the slot of a drained yielding record or of the least recently
        used idle resident (evicting it); None if every such slot is busy."""
        taken = self.slots.reserve(needs_experts)
        if taken is None:
            return None
        slot, victim = taken
        if victim is not None:
            victim.slot = None
            if victim.is_stack and victim.waiting == 0:  # a stack is rebuilt when asked for again
                victim.move_to(S.REMOVED)
                self.drop_stack(victim)
            else:
                victim.move_to(S.KNOWN)
            self.stats.evictions += 1
            log.info("adapter evicted: name=%s slot=%d", victim.name, slot)
        return slot

    def place(self, record: AdapterRecord, slot: int, prepared: PreparedAdapter, t0: float) -> None:
        """Write a KNOWN record's rows into its reserved slot and make it
        resident. The write is queued on the engine ahead of any request
        that can use the slot, so nothing waits for it here."""
        record.move_to(S.LOADING)
        try:
            written = self.backend.write(slot, prepared.rows, recipe_of(record))
        except BaseException:
            record.move_to(S.KNOWN)
            self.slots.free(slot)
            self.stats.load_failures += 1
            raise
        asyncio.ensure_future(written).add_done_callback(lambda f: self._written(record, slot, f))
        self.slots.hold(slot, record)
        record.slot = slot
        record.move_to(S.RESIDENT)
        record.loads += 1
        seconds = time.monotonic() - t0
        self.stats.loads += 1
        self.stats.load_seconds += seconds
        log.info("adapter loaded: name=%s version=%d slot=%d rank=%s path=%s in %.1f ms",
                 record.name, record.version, slot, record.rank, record.path, seconds * 1e3)
        self._wake(record)

    @staticmethod
    def _written(record: AdapterRecord, slot: int, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is not None:
            # Only a stopped engine (which fails every request) or a bug gets here.
            log.error("writing adapter %s into slot %d failed: %r", record.name, slot, done.exception())

    @staticmethod
    def note_weights(record: AdapterRecord, prepared: PreparedAdapter) -> None:
        record.rank, record.adapter_scale = prepared.rank, prepared.scale
        record.format, record.nbytes = prepared.format, prepared.nbytes
        record.expert_nbytes = prepared.expert_nbytes

    def drop_stack(self, stack: AdapterRecord) -> None:
        if stack.state is S.KNOWN:
            stack.move_to(S.REMOVED)
        self._stacks.drop(stack)
        self.tier.drop(stack)

    async def free(self, record: AdapterRecord) -> None:
        """A drained record leaves its slot, which is zeroed and freed."""
        slot = record.slot
        record.slot = None
        record.move_to(S.REMOVED)
        if slot is None:
            return
        await self.clear(slot)
        log.info("adapter unloaded: name=%s slot=%d freed", record.name, slot)

    async def clear(self, slot: int) -> None:
        try:
            await self.backend.remove(slot)
        except Exception:
            # The engine is gone: keep the slot out of use rather than hand
            # it out while it may hold old weights.
            log.exception("could not clear slot %d", slot)
            self.slots.put_out_of_use(slot)
            return
        self.slots.free(slot)
        self._admit()

