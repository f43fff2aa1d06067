"""Moving records in and out of adapter slots, for the registry: reserving a
slot (evicting the least recently used idle resident), queueing the slot
write, prefetching rows into the host tier, making residents yield, releasing
a request's hold, and draining, zeroing and freeing a record's slot. It is
what admission drives (mola.registry.admission.SlotControl). Plain Python on
the event loop; adapters are read by the loader (on its reader thread), and
the slots are the engine's, reached through its SlotPort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ..adapters.loader import AdapterLoader, PreparedAdapter, SlotPort
from ..adapters.recipe import SlotRecipe
from .host_tier import HostTier
from .records import AdapterRecord, AdapterState
from .slots import SlotTable
from .stacks import Stacks
from .waiters import Waiters

log = logging.getLogger("mola.adapters")
S = AdapterState


@dataclass
class RegistryStats:
    loads: int = 0  # adapters written into a slot
    load_failures: int = 0
    evictions: int = 0  # residents moved out to make room
    unloads: int = 0
    load_seconds: float = 0.0  # from the need (a request, a POST) to resident, summed
    leases_resident: int = 0  # requests whose adapter was in a slot already (slot hits)
    leases_loaded: int = 0  # requests that waited for their adapter's load


def recipe_of(record: AdapterRecord) -> SlotRecipe:
    """What the record's slot holds: a stack's parts (their scales already
    multiplied in), or one adapter at its slot_scale."""
    if record.is_stack:
        return SlotRecipe(record.parts, 1.0)
    return SlotRecipe.single(record.path, record.slot_scale)


class Residency:
    def __init__(self, loader: AdapterLoader, port: SlotPort, max_loras: int, tier: HostTier, stacks: Stacks,
                 waiters: Waiters, expert_slots: int = 0):
        self.loader = loader  # reads adapters into slot rows
        self.port = port  # writes and clears the engine's slots
        self.slots = SlotTable(max_loras, expert_slots)
        self.tier = tier
        self.stats = RegistryStats()
        self.waiters = waiters
        self._stacks = stacks
        self._tasks: set[asyncio.Task] = set()

    def has_rows(self, record: AdapterRecord) -> bool:
        return record in self.tier

    def prefetch(self, record: AdapterRecord) -> None:
        async def read() -> PreparedAdapter:
            prepared = await self.loader.prepare(recipe_of(record))
            self.note_weights(record, prepared)
            return prepared

        self.tier.prefetch(record, read, self._read_done)

    def _read_done(self, record: AdapterRecord, error: BaseException | None) -> None:
        if error is not None:  # every request waiting for it now gets the error, nobody else
            self.stats.load_failures += 1
            self.waiters.dismiss(record, error)
            log.info("adapter read failed: name=%s: %s", record.name, error)
        self.waiters.admit(self)

    def install(self, record: AdapterRecord, slot: int) -> None:
        prepared = self.tier.take(record)
        try:
            self.place(record, slot, prepared, self.waiters.queue.since(record))
        except Exception as e:  # the engine is gone: its waiters hear it
            self.waiters.dismiss(record, e)

    def residents(self) -> list[AdapterRecord]:
        return self.slots.holders()

    def set_yielding(self, record: AdapterRecord, yielding: bool) -> None:
        record.move_to(S.YIELDING if yielding else S.RESIDENT)
        if yielding:
            log.info("adapter yielding: name=%s slot=%d in_flight=%d (a request waited %.1f s for a slot)",
                     record.name, record.slot, record.in_flight, self.waiters.queue.max_wait)
        else:
            self.waiters.wake(record)  # its waiters take leases again

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
            written = self.port.write_slot(slot, prepared.rows, recipe_of(record))
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
        self.waiters.wake(record)

    @staticmethod
    def _written(record: AdapterRecord, slot: int, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is not None:
            # Only a stopped engine (which fails every request) or a bug gets here.
            log.error("writing adapter %s into slot %d failed: %r", record.name, slot, done.exception())

    @staticmethod
    def note_weights(record: AdapterRecord, prepared: PreparedAdapter) -> None:
        record.rank, record.file_scale = prepared.rank, prepared.file_scale
        record.format, record.nbytes = prepared.format, prepared.nbytes
        record.expert_nbytes, record.targets = prepared.expert_nbytes, prepared.targets
        record.invocation_tokens, record.kind = prepared.invocation_tokens, prepared.kind
        record.vocab = prepared.vocab

    def drop_stack(self, stack: AdapterRecord) -> None:
        if stack.state is S.KNOWN:
            stack.move_to(S.REMOVED)
        self._stacks.drop(stack)
        self.tier.drop(stack)

    def release(self, record: AdapterRecord) -> None:
        """A request running on ``record`` ended (its Lease was released)."""
        record.in_flight -= 1
        if record.in_flight == 0:
            if record.state is S.DRAINING:
                self._spawn(self.free(record))
            else:
                self.tier.settle()  # no longer pinned
                self.waiters.admit(self)  # an idle resident can be evicted now, a yielding one has drained

    async def retire(self, record: AdapterRecord) -> None:
        """A record no longer current: its rows leave the host tier, its
        waiters are woken (and find it gone), and it drains if resident."""
        self.tier.drop(record)
        self.waiters.dismiss(record)
        if record.state in (S.RESIDENT, S.YIELDING):
            record.move_to(S.DRAINING)
            if record.in_flight == 0:
                await self.free(record)
        elif record.state is S.KNOWN:
            record.move_to(S.REMOVED)
        # DRAINING or REMOVED: nothing more to do. (LOADING lasts no longer
        # than one call on the event loop.)

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
            await self.port.clear_slot(slot)
        except Exception:
            # The engine is gone: keep the slot out of use rather than hand
            # it out while it may hold old weights.
            log.exception("could not clear slot %d", slot)
            self.slots.put_out_of_use(slot)
            return
        self.slots.free(slot)
        self.waiters.admit(self)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

