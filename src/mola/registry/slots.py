"""Which adapter slot holds what: the slot allocator.

Slots 1..max_loras (slot 0 is the base model) are each free, reserved for a
load in progress, held by a resident record, or out of use (a slot whose
clearing failed, which may still hold old weights). A slot is taken free
first, else from a yielding record that has drained, else from the least
recently used resident that no request uses or waits for (that record is
evicted).

On a mixture-of-experts base, slots 1..expert_slots can also carry LoRA on the
experts. An adapter with expert LoRA takes one of those; an adapter without
takes another slot first, and one of those only when no other is free or
evictable, so that expert slots stay for the adapters that need them.
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
    def __init__(self, max_loras: int, expert_slots: int = 0):
        assert 0 <= expert_slots <= max_loras, (expert_slots, max_loras)
        self.max_loras = max_loras
        self.expert_slots = expert_slots
        self._slots = {s: Slot() for s in range(1, max_loras + 1)}

    @property
    def num_free(self) -> int:
        return sum(s.use is SlotUse.FREE for s in self._slots.values())

    @property
    def num_held(self) -> int:
        return sum(s.use is SlotUse.HELD for s in self._slots.values())

    def holders(self) -> list[AdapterRecord]:
        return [s.holder for s in self._slots.values() if s.use is SlotUse.HELD]

    def can_carry(self, number: int, needs_experts: bool) -> bool:
        return not needs_experts or number <= self.expert_slots

    def reserve(self, needs_experts: bool = False) -> tuple[int, AdapterRecord | None] | None:
        """Reserve a slot that can carry the adapter (see the module's doc):
        a free one, or else the slot of a drained yielding record or of the
        least recently used evictable resident, returned with it (the caller
        evicts it). None when every such slot is busy."""
        # Slots without expert packs first (an adapter without expert LoRA).
        order = sorted((n for n in self._slots if self.can_carry(n, needs_experts)),
                       key=lambda n: (n <= self.expert_slots, n))
        for number in order:
            slot = self._slots[number]
            if slot.use is SlotUse.FREE:
                slot.use = SlotUse.RESERVED
                return number, None
        idle = [r for r in self.holders() if r.is_evictable and self.can_carry(r.slot, needs_experts)]
        if not idle:
            return None
        victim = min(idle, key=lambda r: (r.state is not AdapterState.YIELDING, r.slot <= self.expert_slots,
                                          r.last_used or 0.0, r.uid))
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
