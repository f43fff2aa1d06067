"""An adapter record's lifecycle: the one table of transitions, every allowed
and every refused move, and the registry driving records through them on a
real engine (mola/registry/records.py, mola/registry/registry.py)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from mola.errors import InvalidAdapter, ModelNotFound
from mola.registry.records import TRANSITIONS, AdapterRecord, AdapterState, InvalidTransition

from helpers.engines import run_registry
from helpers.servers import settle

S = AdapterState
ALLOWED = {
    (S.KNOWN, S.LOADING), (S.KNOWN, S.REMOVED),
    (S.LOADING, S.RESIDENT), (S.LOADING, S.KNOWN), (S.LOADING, S.REMOVED),
    (S.RESIDENT, S.KNOWN), (S.RESIDENT, S.DRAINING), (S.RESIDENT, S.REMOVED), (S.RESIDENT, S.YIELDING),
    (S.YIELDING, S.RESIDENT), (S.YIELDING, S.KNOWN), (S.YIELDING, S.REMOVED), (S.YIELDING, S.DRAINING),
    (S.DRAINING, S.REMOVED),
}


UIDS = itertools.count(1)  # records' uids, as a registry's counter gives them


def record_in(state: AdapterState) -> AdapterRecord:
    r = AdapterRecord(name="x", path="/x", source="rest", version=1, uid=next(UIDS))
    r.state = state  # set directly: the table under test is what move_to checks
    return r


@pytest.mark.parametrize("old, new", list(itertools.product(S, S)))
def test_every_move_is_allowed_or_refused_by_the_table(old, new):
    record = record_in(old)
    if (old, new) in ALLOWED:
        record.move_to(new)
        assert record.state is new
    else:
        with pytest.raises(InvalidTransition, match=f"{old.value} -> {new.value}"):
            record.move_to(new)
        assert record.state is old  # a refused move changes nothing


def test_the_table_is_the_documented_one():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED


def run(engine, scenario):
    """Run ``scenario(registry)`` on a fresh registry with one slot; then its
    slot is free or held, once the slot clears it spawned are done."""
    async def checked(registry):
        await scenario(registry)
        await settle(lambda: registry.num_free_slots + registry.num_resident == 1)
    run_registry(engine, checked)


def test_load_evict_unload_walks_the_table(engine, adapters):
    async def scenario(registry):
        a = await registry.load("a", str(adapters["a"]))
        assert a.state is S.RESIDENT and a.slot == 1
        b = registry.register("b", str(adapters["b"]), "rest")
        assert b.state is S.KNOWN
        lease = await registry.acquire("b")  # the only slot goes to b: a is evicted
        assert (a.state, a.slot, b.state, b.slot) == (S.KNOWN, None, S.RESIDENT, 1)
        await registry.unload("b")  # a request still runs on it
        assert b.state is S.DRAINING and b.resident
        lease.release()  # b drains: its slot is cleared on the engine, then freed
        await settle(lambda: registry.num_free_slots == 1)
        assert b.state is S.REMOVED
        await registry.unload("a")
        assert a.state is S.REMOVED
    run(engine, scenario)


def test_a_failed_load_goes_back_to_known(engine, adapters, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{")

    async def scenario(registry):
        record = registry.register("broken", str(broken), "rest")
        with pytest.raises(InvalidAdapter):
            await registry.acquire("broken")
        assert record.state is S.KNOWN and record.slot is None and registry.num_free_slots == 1
        assert registry.stats.load_failures == 1
    run(engine, scenario)


def test_unloaded_while_waiting_for_a_slot_is_removed(engine, adapters):
    async def scenario(registry):
        await registry.load("a", str(adapters["a"]))
        busy = await registry.acquire("a")  # the only slot is busy
        b = registry.register("b", str(adapters["b"]), "rest")
        waiter = asyncio.ensure_future(registry.acquire("b"))
        await settle(lambda: registry.queue.ordered() == [b])  # waiting for a slot
        assert b.state is S.KNOWN
        await registry.unload("b")
        with pytest.raises(ModelNotFound):
            await waiter
        assert b.state is S.REMOVED
        busy.release()
    run(engine, scenario)
