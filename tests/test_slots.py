"""The slot allocator: free slots first, then the least recently used idle
resident; busy, reserved and out-of-use slots are never handed out
(mola/lora/slots.py)."""

from __future__ import annotations

from mola.lora.records import AdapterRecord, AdapterState
from mola.lora.slots import SlotTable, SlotUse


def resident(name: str, slot: int, last_used: float, in_flight: int = 0) -> AdapterRecord:
    r = AdapterRecord(name=name, path=f"/{name}", source="rest", version=1)
    r.state, r.slot, r.last_used, r.in_flight = AdapterState.RESIDENT, slot, last_used, in_flight
    return r


def test_free_slots_first_then_the_lru_idle_resident():
    table = SlotTable(3)
    taken = [table.reserve() for _ in range(3)]
    assert taken == [(1, None), (2, None), (3, None)]
    assert table.reserve() is None  # all reserved: loads in progress are never victims
    old, busy, new = resident("old", 1, 1.0), resident("busy", 2, 0.5, in_flight=1), resident("new", 3, 9.0)
    for r in (old, busy, new):
        table.hold(r.slot, r)
    assert table.num_held == 3 and table.num_free == 0
    assert table.reserve() == (1, old)  # busy is older but in use
    assert table.use_of(1) is SlotUse.RESERVED
    new.waiting = 1  # a request waits for it: not a victim either
    assert table.reserve() is None


def test_freed_and_out_of_use_slots():
    table = SlotTable(2)
    table.reserve(), table.reserve()
    table.free(1)
    table.put_out_of_use(2)  # its clearing failed: may hold old weights
    assert table.reserve() == (1, None)
    assert table.reserve() is None and table.use_of(2) is SlotUse.OUT_OF_USE
