"""Which adapter slot holds what: the slot allocator.

Slots 1..max_loras (slot 0 is the base model) are each free, reserved for a
load in progress, held by a resident record, or out of use (a slot whose
clearing failed, which may still hold old weights). A slot is taken free
first, else from a yielding record that has drained, else from the least
recently used resident that no request uses or waits for (that record is
evicted).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .records import AdapterRecord, AdapterState


class SlotUse(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"  # a load is writing into it
    HELD = "held"  # a resident record serves from it
    OUT_OF_USE = "out_of_use"  # clearing it failed; never handed out again


@dataclass
class Slot:
    use: SlotUse = SlotUse.FREE
    holder: AdapterRecord | None = None  # with HELD


class SlotTable:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slots = {s: Slot() for s in range(1, max_loras + 1)}

    @property
    def num_free(self) -> int:
        return sum(s.use is SlotUse.FREE for s in self._slots.values())

    @property
    def num_held(self) -> int:
        return sum(s.use is SlotUse.HELD for s in self._slots.values())

    def holders(self) -> list[AdapterRecord]:
        return [s.holder for s in self._slots.values() if s.use is SlotUse.HELD]

    def reserve(self) -> tuple[int, AdapterRecord | None] | None:
        """Reserve a slot: a free one, or else the slot of a drained yielding
        record or of the least recently used evictable resident, returned
        with it (the caller evicts it). None when every slot is busy."""
        for number, slot in self._slots.items():
            if slot.use is SlotUse.FREE:
                slot.use = SlotUse.RESERVED
                return number, None
        idle = [r for r in self.holders() if r.is_evictable]
        if not idle:
            return None
        victim = min(idle, key=lambda r: (r.state is not AdapterState.YIELDING, r.last_used or 0.0, r.uid))
        number = victim.slot
        self._slots[number] = Slot(SlotUse.RESERVED)
        return number, victim

    def hold(self, number: int, record: AdapterRecord) -> None:
        """A reserved slot now serves ``record``."""
        assert self._slots[number].use is SlotUse.RESERVED, (number, self._slots[number])
        self._slots[number] = Slot(SlotUse.HELD, record)

    def free(self, number: int) -> None:
        """The slot is empty again (its weights are zero, or were never written)."""
        assert self._slots[number].use is not SlotUse.FREE, number
        self._slots[number] = Slot()

    def put_out_of_use(self, number: int) -> None:
        self._slots[number] = Slot(SlotUse.OUT_OF_USE)

    def use_of(self, number: int) -> SlotUse:
        return self._slots[number].use
