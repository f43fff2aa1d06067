"""Fair admission to slots: oldest waiting adapter first, a bounded wait for
an adapter whose slot is held by one with continuous traffic (and, without
the bound, the starvation it prevents), yields taken back when the need goes,
and exact outputs through a server while adapters take turns in one slot
(mola/registry/admission.py, mola/registry/registry.py)."""

from __future__ import annotations

import itertools

import asyncio
import time

import httpx
import pytest

from mola.config import AdapterSpec
from mola.engine.client import AsyncEngine
from mola.engine.engine import Engine, EngineConfig
from mola.models.loader import load_base_model
from mola.registry.host_tier import HostTier
from mola.adapters.loader import AdapterLoader
from mola.registry.records import AdapterRecord, AdapterState
from mola.registry.registry import AdapterRegistry
from mola.testing.adapter import make_random_adapter

from helpers import greedy_tokens, merged_model, start_server

S = AdapterState


UIDS = itertools.count(1)  # records' uids, as a registry's counter gives them


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = Engine(lambda: load_base_model(str(tiny_model)), EngineConfig(max_loras=1, max_lora_rank=16))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def paths(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    return {n: make_random_adapter(root / n, tiny_model, rank=4, seed=400 + i)
            for i, n in enumerate(["hot", "cold", "b", "c", "d"])}


def run(engine, paths, scenario, max_wait=float("inf")):
    """``scenario(registry)`` on a fresh one-slot registry with a host tier."""
    async def main():
        loader = AdapterLoader(AsyncEngine(engine), engine.loaded.config)
        registry = AdapterRegistry("tiny", loader, 1, tier=HostTier(max_entries=8), max_wait=max_wait)
        for name, path in paths.items():
            registry.register(name, str(path), "rest")
        try:
            await asyncio.wait_for(scenario(registry), timeout=60)
        finally:
            registry.close()
            loader.close()
    asyncio.run(main())


async def request(registry, name: str, hold: float, log: list | None = None) -> float:
    """Take a lease on ``name`` (the wait is returned), hold it ``hold`` s."""
    t0 = time.monotonic()
    lease = await registry.acquire(name)
    waited = time.monotonic() - t0
    if log is not None:
        log.append(name)
    await asyncio.sleep(hold)
    lease.release()
    return waited


async def hot_traffic(registry, seconds: float, every=0.05, hold=0.15) -> list[asyncio.Task]:
    """A request for "hot" every 50 ms, each holding its lease 150 ms: they
    overlap, so without a bound "hot" never goes idle."""
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(request(registry, "hot", hold)))
        await asyncio.sleep(every)
    return tasks


def starvation_scenario(max_wait: float):
    """(the cold request's wait, the longest hot wait, the registry's admission stats)."""
    out = {}

    async def scenario(registry):
        traffic = asyncio.ensure_future(hot_traffic(registry, 2.5))
        await asyncio.sleep(0.4)  # hot is resident and busy
        assert registry.get("hot").state is S.RESIDENT
        cold = await request(registry, "cold", 0.05)
        hot = await asyncio.gather(*await traffic)
        out.update(cold=cold, hot=max(hot), stats=registry.queue.stats, hot_state=registry.get("hot").state)
    return out, scenario


def test_a_cold_request_gets_the_slot_within_the_bound(engine, paths):
    out, scenario = starvation_scenario(max_wait=0.3)
    run(engine, {k: paths[k] for k in ("hot", "cold")}, scenario, max_wait=0.3)
    # bound: max_wait + the longest hot lease (0.15 s) + slack for a loaded machine
    assert out["cold"] <= 0.3 + 0.15 + 0.5, out
    assert out["stats"].yields >= 1 and out["stats"].starved >= 1
    assert out["hot"] <= 0.3 + 0.05 + 0.5, out  # hot's own requests waited, boundedly, for the slot back


def test_without_the_bound_the_cold_request_starves(engine, paths):
    """The same traffic with no bound: the cold request waits until the hot
    traffic stops (which is what the bound above prevents)."""
    out, scenario = starvation_scenario(max_wait=float("inf"))
    run(engine, {k: paths[k] for k in ("hot", "cold")}, scenario)
    assert out["cold"] >= 1.5, out
    assert out["stats"].yields == 0


def test_slots_go_to_waiting_adapters_oldest_first(engine, paths):
    async def scenario(registry):
        first = await registry.acquire("hot")
        admitted = registry.queue.stats.admitted
        order = []
        waiters = []
        for name in ("d", "b", "c"):
            waiters.append(asyncio.ensure_future(request(registry, name, 0.02, order)))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(_all_cached(registry, ("d", "b", "c")), 10)  # read while waiting
        first.release()
        await asyncio.gather(*waiters)
        assert order == ["d", "b", "c"]
        assert registry.queue.stats.admitted == admitted + 3
    run(engine, paths, scenario)


def test_a_slot_goes_to_the_adapter_with_most_waiters_unless_one_starves(engine, paths):
    async def scenario(registry):
        first = await registry.acquire("hot")
        order = []
        lone = asyncio.ensure_future(request(registry, "b", 0.02, order))  # the oldest, alone
        await asyncio.sleep(0.02)
        crowd = [asyncio.ensure_future(request(registry, "c", 0.05, order)) for _ in range(3)]
        await asyncio.wait_for(_all_cached(registry, ("b", "c")), 10)
        first.release()  # nobody starves yet: c's three requests come first
        await asyncio.gather(lone, *crowd)
        assert order == ["c", "c", "c", "b"]
        held = await registry.acquire("hot")
        order.clear()
        lone = asyncio.ensure_future(request(registry, "b", 0.02, order))
        await asyncio.sleep(0.02)
        crowd = [asyncio.ensure_future(request(registry, "c", 0.05, order)) for _ in range(3)]
        await asyncio.sleep(0.4)  # b has waited past max_wait (hot yields, and its slot goes to b)
        held.release()
        await asyncio.gather(lone, *crowd)
        assert order[0] == "b"
    run(engine, paths, scenario, max_wait=0.3)


async def _all_cached(registry, names):
    while not all(registry.get(n).cached for n in names):
        await asyncio.sleep(0.005)


def test_a_yield_is_taken_back_when_the_waiter_leaves(engine, paths):
    async def scenario(registry):
        running = await registry.acquire("hot")  # one long request: hot never drains
        cold = asyncio.ensure_future(registry.acquire("cold"))
        await asyncio.sleep(0.35)
        assert registry.get("hot").state is S.YIELDING
        later = asyncio.ensure_future(registry.acquire("hot"))  # a yielding adapter takes no new request
        await asyncio.sleep(0.05)
        assert not later.done()
        cold.cancel()  # e.g. the client went away, or --request-timeout
        lease = await asyncio.wait_for(later, 5)
        assert registry.get("hot").state is S.RESIDENT and registry.queue.stats.yields_cancelled == 1
        lease.release()
        running.release()
        assert registry.get("cold").state is S.KNOWN and len(registry.queue) == 0
    run(engine, paths, scenario, max_wait=0.3)


def test_at_most_a_quarter_of_the_slots_yield_at_once(tiny_model, paths):
    """Four slots, all busy; three adapters starve: one resident yields at a
    time, the other three keep serving, and the starving adapters get slots
    in arrival order."""
    engine = Engine(lambda: load_base_model(str(tiny_model)), EngineConfig(max_loras=4, max_lora_rank=16))
    engine.start()

    async def scenario(registry):
        extra = [registry.register(f"e{i}", str(paths["hot"]), "rest") for i in range(4)]
        busy = [await registry.acquire(r.name) for r in extra]  # one long request on each slot
        order = []
        starving = []
        for name in ("b", "c", "d"):
            starving.append(asyncio.ensure_future(request(registry, name, 0.01, order)))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.4)  # all three starve
        assert sum(r.state is S.YIELDING for r in extra) == 1 and registry.queue.stats.yields == 1
        for lease in busy:  # each long request ends in turn
            lease.release()
            await asyncio.sleep(0.05)
        await asyncio.gather(*starving)
        assert order == ["b", "c", "d"]

    async def main():
        loader = AdapterLoader(AsyncEngine(engine), engine.loaded.config)
        registry = AdapterRegistry("tiny", loader, 4, tier=HostTier(max_entries=8), max_wait=0.3)
        for name in ("b", "c", "d"):
            registry.register(name, str(paths[name]), "rest")
        try:
            await asyncio.wait_for(scenario(registry), timeout=60)
        finally:
            registry.close()
            loader.close()
    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_adapters_taking_turns_in_one_slot_answer_exactly(tiny_model, paths):
    """Through a server with one slot: three clients keep "hot" busy while a
    request for "cold" comes; every answer is its adapter's own, as plain
    mlx-lm on merged weights gives it."""
    server = start_server(model=str(tiny_model), served_model_name="tiny", max_loras=1, max_lora_rank=16,
                          adapters=(AdapterSpec("hot", str(paths["hot"])),),
                          adapter_dirs=(str(paths["cold"].parent),), max_cpu_loras=4, max_adapter_wait=0.3)
    try:
        tok = server.state.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
        expected = {}
        for name in ("hot", "cold"):
            model, _ = merged_model(tiny_model, [paths[name]])
            expected[name] = greedy_tokens(model, prompt, 24)
        assert expected["hot"] != expected["cold"]
        body = lambda m: {"model": m, "prompt": prompt, "max_tokens": 24, "temperature": 0,  # noqa: E731
                          "ignore_eos": True, "logprobs": 0}

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                end = time.monotonic() + 2.0

                async def client():
                    outs = []
                    while time.monotonic() < end:
                        outs.append(await c.post("/v1/completions", json=body("hot")))
                    return outs

                clients = [asyncio.ensure_future(client()) for _ in range(3)]
                await asyncio.sleep(0.5)
                cold = await c.post("/v1/completions", json=body("cold"))
                return cold, [r for outs in await asyncio.gather(*clients) for r in outs]

        cold, hots = asyncio.run(go())
        pieces = {n: [tok.decode([t]) for t in ts] for n, ts in expected.items()}
        assert cold.status_code == 200 and pieces_of(cold) == pieces["cold"]
        assert hots and all(r.status_code == 200 and pieces_of(r) == pieces["hot"] for r in hots)
        admission = httpx.get(server.url + "/v1/adapters").json()["admission"]
        assert admission["admitted"] >= 1 and admission["max_wait_seconds"] < 5
    finally:
        server.stop()


def pieces_of(response) -> list[str]:
    """The text of each token of a completion (its logprobs' tokens)."""
    return response.json()["choices"][0]["logprobs"]["tokens"]


def rec(name: str, last_used: float, in_flight: int) -> AdapterRecord:

    r = AdapterRecord(name=name, path=f"/{name}", source="rest", version=1, uid=next(UIDS))
    r.state, r.last_used, r.in_flight = S.RESIDENT, last_used, in_flight
    return r


def test_the_yielder_is_the_resident_likely_to_drain_soonest():
    from mola.registry.admission import pick_yielder

    hot, old, older_idle = rec("hot", 9.0, 5), rec("old", 2.0, 2), rec("idle", 1.0, 0)
    assert pick_yielder([hot, old, older_idle]) is old  # no new request for longest; idle ones need no yield
    assert pick_yielder([older_idle]) is None
    tie = rec("tie", 2.0, 1)
    assert pick_yielder([old, tie]) is tie  # same age: fewer requests to finish


def test_the_queue_orders_by_oldest_request_and_times_starvation():
    from mola.registry.admission import AdmissionQueue

    q = AdmissionQueue(max_wait=1.0)
    a, b = rec("a", 0, 0), rec("b", 0, 0)
    ta = q.join(a, now=10.0)
    q.join(b, now=10.5)
    q.join(a, now=11.0)  # a's later request does not make a younger
    assert q.ordered() == [a, b] and q.next_starving_at(10.6) == 11.0
    assert q.is_starving(a, 11.0) and not q.is_starving(b, 11.0)
    q.leave(a, ta)  # a's oldest request went away: a now counts from 11.0
    assert q.ordered() == [b, a] and q.next_starving_at(11.2) == 11.5
    with pytest.raises(ValueError, match="max_wait"):
        AdmissionQueue(max_wait=0)


class _Control:
    """What admit() drives, in plain Python: slots 1..n (1..experts carry
    expert LoRA), records by name, rows read for every waiting record."""

    def __init__(self, residents, experts: int, needs: set[str], free: list[int]):
        self.resident, self.experts, self.needs, self.free = list(residents), experts, needs, free
        self.installed, self.yielding = [], []

    def has_rows(self, record):
        return True

    def prefetch(self, record):
        raise AssertionError("every record is read")

    def slot_for(self, record):
        ok = [s for s in self.free if record.name not in self.needs or s <= self.experts]
        if ok:
            self.free.remove(ok[0])
        return ok[0] if ok else None

    def can_serve(self, resident, record):
        return record.name not in self.needs or resident.slot <= self.experts

    def install(self, record, slot):
        self.installed.append((record.name, slot))

    def residents(self):
        return list(self.resident)

    def set_yielding(self, record, yielding):
        record.state = S.YIELDING if yielding else S.RESIDENT
        (self.yielding.append if yielding else self.yielding.remove)(record.name)


def test_a_starving_expert_adapter_makes_an_expert_slot_yield_not_a_dense_one():
    from mola.registry.admission import AdmissionQueue, admit
    from mola.registry.records import AdapterRecord

    def record(name, slot=None, last_used=0.0, in_flight=0):
        r = AdapterRecord(name=name, path=f"/{name}", source="rest", version=1, uid=next(UIDS))
        if slot is not None:
            r.state, r.slot, r.last_used, r.in_flight = S.RESIDENT, slot, last_used, in_flight
        return r

    # Slot 1 carries experts; slot 2 does not and is the least recently used, which
    # a dense waiter would make yield.
    expert_res, dense_res = record("e", 1, last_used=5.0, in_flight=2), record("d", 2, last_used=1.0, in_flight=1)
    waiting = record("needs-experts")
    control = _Control([expert_res, dense_res], experts=1, needs={"needs-experts"}, free=[])
    queue = AdmissionQueue(max_wait=1.0)
    queue.join(waiting, now=0.0)
    admit(queue, control, now=0.5, max_yielding=1)
    assert control.yielding == []  # not starving yet
    admit(queue, control, now=2.0, max_yielding=1)
    assert control.yielding == ["e"]  # the one whose slot can carry it, though d is older
    control.free.append(1)  # e drained; its slot is free
    admit(queue, control, now=2.5, max_yielding=1)
    assert control.installed == [("needs-experts", 1)]
    assert control.yielding == []  # no adapter is left without a slot: the yield is taken back
