"""The slot allocator: free slots first, then the least recently used idle
resident; busy, reserved and out-of-use slots are never handed out
(mola/registry/slots.py)."""

from __future__ import annotations

import itertools

from mola.registry.records import AdapterRecord, AdapterState
from mola.registry.slots import SlotTable, SlotUse


UIDS = itertools.count(1)  # records' uids, as a registry's counter gives them


def resident(name: str, slot: int, last_used: float, in_flight: int = 0) -> AdapterRecord:
    r = AdapterRecord(name=name, path=f"/{name}", source="rest", version=1, uid=next(UIDS))
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


def test_expert_adapters_take_expert_slots_and_others_take_the_rest_first():
    table = SlotTable(4, expert_slots=2)  # slots 1 and 2 carry expert packs
    assert table.reserve(needs_experts=False) == (3, None)  # a dense adapter leaves them alone
    assert table.reserve(needs_experts=True) == (1, None)
    assert table.reserve(needs_experts=False) == (4, None)
    assert table.reserve(needs_experts=False) == (2, None)  # only when nothing else is free
    dense_old, expert, dense3, dense4 = (resident("d-old", 2, 1.0), resident("e", 1, 5.0),
                                         resident("d3", 3, 3.0), resident("d4", 4, 4.0))
    for r in (dense_old, expert, dense3, dense4):
        table.hold(r.slot, r)
    # An expert adapter evicts only from expert slots: the oldest there, not d3/d4.
    assert table.reserve(needs_experts=True) == (2, dense_old)
    table.hold(2, resident("e2", 2, 6.0))
    # A dense adapter evicts from the other slots first, even a newer one.
    assert table.reserve(needs_experts=False) == (3, dense3)
    expert.in_flight = 1
    table._slots[2].holder.in_flight = 1
    assert table.reserve(needs_experts=True) is None  # both expert slots busy: it waits
