"""Fair admission to slots (mola/registry/admission.py), on an explicit clock:
oldest waiting adapter first, most waiters first unless one starves, a bounded
wait for an adapter whose slot is held by one with continuous traffic (and,
without the bound, the starvation it prevents), at most a quarter of the slots
yielding at once, yields taken back when the need goes, expert slots for
expert adapters. admit() is driven as the registry drives it, by a model of
the registry's side (tests/registry_model.py: requests lease a resident
adapter or wait in line) over slots kept in plain Python. Then on the real
registry, the one thing that is about real time: the timer that runs
admission again when a waiter starts to starve; and through a server, exact
outputs while adapters take turns in one slot."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mola.config import AdapterSpec
from mola.registry.admission import AdmissionQueue, admit, pick_yielder
from mola.registry.host_tier import HostTier
from mola.registry.records import AdapterState
from mola.testing.adapter import make_random_adapter

from helpers.engines import run_registry
from helpers.references import greedy_tokens, merged_model
from helpers.servers import settle, start_server
from registry_model import Registry, Request, Slots, rec

S = AdapterState


def waits(requests: list[Request]) -> list[float]:
    return [r.started - r.arrival for r in requests]


# Times in milliseconds (exact integer arithmetic): a request for "hot" every
# 50 ms for 2.5 s, each holding its lease 150 ms, so they overlap and "hot"
# never goes idle; one request for "cold" at 400 ms.
HOT = [(t, "hot", 150) for t in range(0, 2500, 50)]
COLD = [(400, "cold", 50)]


def test_a_cold_request_gets_the_slot_within_the_bound():
    registry = Registry(Slots(1), max_wait=300)
    made = registry.run(HOT + COLD, until=3000)
    (cold,) = made["cold"]
    assert 300 <= cold.started - cold.arrival <= 300 + 150  # max_wait + what the hot leases had left
    stats = registry.queue.stats
    assert (stats.yields, stats.starved) == (1, 1) and stats.max_wait_seconds == cold.started - cold.arrival
    assert max(waits(made["hot"])) <= 150 + 50  # hot waited, boundedly, for its slot back
    assert all(r.started is not None for r in made["hot"])


def test_without_the_bound_the_cold_request_starves():
    """The same traffic with no bound: the cold request waits until the hot
    traffic stops (which is what the bound above prevents)."""
    registry = Registry(Slots(1))
    made = registry.run(HOT + COLD, until=3000)
    (cold,) = made["cold"]
    assert cold.started >= max(r.started + r.hold for r in made["hot"])  # after the last hot lease
    assert registry.queue.stats.yields == 0 and max(waits(made["hot"])) == 0


def test_slots_go_to_waiting_adapters_oldest_first():
    registry = Registry(Slots(1))
    registry.run([(0, "hot", 1000), (100, "d", 20), (150, "b", 20), (200, "c", 20)], until=1200)
    assert [r.name for r in registry.leased] == ["hot", "d", "b", "c"]
    assert registry.queue.stats.admitted == 4


def test_a_slot_goes_to_the_adapter_with_most_waiters_unless_one_starves():
    crowd = [(20, "c", 50)] * 3
    registry = Registry(Slots(1), max_wait=300)
    registry.run([(0, "hot", 100), (10, "b", 20), *crowd], until=400)  # nobody starves
    assert [r.name for r in registry.leased] == ["hot", "c", "c", "c", "b"]
    registry = Registry(Slots(1), max_wait=300)
    registry.run([(0, "hot", 1000), (10, "b", 20), *crowd], until=1200)  # b starves at 310: hot yields
    assert [r.name for r in registry.leased] == ["hot", "b", "c", "c", "c"]


def test_a_yield_is_taken_back_when_the_waiter_leaves():
    registry = Registry(Slots(1), max_wait=300)
    registry.run([(0, "hot", 10_000), (10, "cold", 20)], until=400)
    hot, (cold,) = registry.record("hot"), registry.waiting
    assert hot.state is S.YIELDING
    later = registry.ask("hot", 400, 20)  # a yielding adapter takes no new request
    assert later.started is None
    registry.cancel(cold, 450)  # e.g. the client went away, or --request-timeout
    assert hot.state is S.RESIDENT and later.started == 450
    assert registry.queue.stats.yields_cancelled == 1 and len(registry.queue) == 0


def test_at_most_a_quarter_of_the_slots_yield_at_once():
    """Four slots, all busy; three adapters starve: one resident yields at a
    time, the other three keep serving, and the starving adapters get slots
    in arrival order."""
    registry = Registry(Slots(4), max_wait=300)
    busy = [(i, f"e{i}", 500 + 100 * i) for i in range(4)]  # one long request on each slot
    registry.run([*busy, (10, "b", 10), (20, "c", 10), (30, "d", 10)], until=400)  # all three starve
    assert sum(registry.record(f"e{i}").state is S.YIELDING for i in range(4)) == 1
    assert registry.queue.stats.yields == 1
    registry.run([], until=1000)
    assert [r.name for r in registry.leased[4:]] == ["b", "c", "d"]


def test_a_starving_expert_adapter_makes_an_expert_slot_yield_not_a_dense_one():
    # Slot 1 carries experts; slot 2 does not and is the least recently used,
    # which a dense waiter would make yield.
    slots = Slots(2, experts=1, needs=frozenset({"needs-experts"}))
    expert, dense = rec("e", 1, last_used=5.0, in_flight=2), rec("d", 2, last_used=1.0, in_flight=1)
    slots.holders = {1: expert, 2: dense}
    waiting = rec("needs-experts")
    slots.read.add(waiting)
    queue = AdmissionQueue(max_wait=1.0)
    queue.join(waiting, now=0.0)
    admit(queue, slots, now=0.5, max_yielding=1)
    assert (expert.state, dense.state) == (S.RESIDENT, S.RESIDENT)  # not starving yet
    admit(queue, slots, now=2.0, max_yielding=1)
    assert (expert.state, dense.state) == (S.YIELDING, S.RESIDENT)  # the one whose slot can carry it
    expert.in_flight = 0  # e drained
    admit(queue, slots, now=2.5, max_yielding=1)
    assert slots.installed == [("needs-experts", 1)] and dense.state is S.RESIDENT


def test_the_yielder_is_the_resident_likely_to_drain_soonest():
    hot, old, older_idle = rec("hot", 1, 9.0, 5), rec("old", 2, 2.0, 2), rec("idle", 3, 1.0, 0)
    assert pick_yielder([hot, old, older_idle]) is old  # no new request for longest; idle ones need no yield
    assert pick_yielder([older_idle]) is None
    tie = rec("tie", 4, 2.0, 1)
    assert pick_yielder([old, tie]) is tie  # same age: fewer requests to finish


def test_the_queue_orders_by_oldest_request_and_times_starvation():
    q = AdmissionQueue(max_wait=1.0)
    a, b = rec("a"), rec("b")
    ta = q.join(a, now=10.0)
    q.join(b, now=10.5)
    q.join(a, now=11.0)  # a's later request does not make a younger
    assert q.ordered() == [a, b] and q.next_starving_at(10.6) == 11.0
    assert q.is_starving(a, 11.0) and not q.is_starving(b, 11.0)
    q.leave(a, ta)  # a's oldest request went away: a now counts from 11.0
    assert q.ordered() == [b, a] and q.next_starving_at(11.2) == 11.5
    with pytest.raises(ValueError, match="max_wait"):
        AdmissionQueue(max_wait=0)


@pytest.fixture(scope="module")
def paths(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    return {n: make_random_adapter(root / n, tiny_model, rank=4, seed=400 + i) for i, n in enumerate(["hot", "cold"])}


def test_the_registry_s_timer_makes_a_busy_resident_yield(engine, paths):
    """Real time: with nothing else happening, the admission pass runs again
    when the waiting request starts to starve (max_wait, 50 ms here), and
    the busy resident yields; the yield is taken back when the waiter leaves."""
    async def scenario(registry):
        for name, path in paths.items():
            registry.register(name, str(path), "rest")
        running = await registry.acquire("hot")  # one long request: hot never drains
        cold = asyncio.ensure_future(registry.acquire("cold"))
        hot = registry.get("hot")
        await settle(lambda: hot.state is S.YIELDING, timeout=10)
        later = asyncio.ensure_future(registry.acquire("hot"))
        await settle(lambda: hot.waiting == 1)  # in line: a yielding adapter takes no new request
        assert not later.done()
        cold.cancel()
        lease = await asyncio.wait_for(later, 5)
        assert hot.state is S.RESIDENT and registry.queue.stats.yields_cancelled == 1
        lease.release()
        running.release()
        assert registry.get("cold").state is S.KNOWN and len(registry.queue) == 0
    run_registry(engine, scenario, tier=HostTier(max_entries=8), max_wait=0.05)


def test_adapters_taking_turns_in_one_slot_answer_exactly(tiny_model, paths):
    """Through a server with one slot: three clients keep "hot" busy until a
    request for "cold" is answered; every answer is its adapter's own, as
    plain mlx-lm on merged weights gives it."""
    server = start_server(model=str(tiny_model), served_model_name="tiny", max_loras=1, max_lora_rank=16,
                          adapters=(AdapterSpec("hot", str(paths["hot"])),),
                          adapter_dirs=(str(paths["cold"].parent),), max_cpu_loras=4, max_adapter_wait=0.3)
    try:
        tok = server.state.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
        expected = {}
        for name in ("hot", "cold"):
            model, _ = merged_model(tiny_model, [paths[name]])
            expected[name] = [tok.decode([t]) for t in greedy_tokens(model, prompt, 24)]
        assert expected["hot"] != expected["cold"]
        cold, hots = asyncio.run(asyncio.wait_for(take_turns(server.url, prompt), 120))
        assert cold.status_code == 200 and pieces_of(cold) == expected["cold"]
        assert hots and all(r.status_code == 200 and pieces_of(r) == expected["hot"] for r in hots)
        admission = httpx.get(server.url + "/v1/adapters").json()["admission"]
        assert admission["admitted"] >= 1 and admission["max_wait_seconds"] < 5
    finally:
        server.stop()


async def take_turns(url: str, prompt: list[int]):
    """Three clients ask for "hot" in a loop; once each has an answer, one
    request for "cold"; the loops stop when it is answered."""
    body = lambda m: {"model": m, "prompt": prompt, "max_tokens": 24, "temperature": 0,  # noqa: E731
                      "ignore_eos": True, "logprobs": 0}
    answered = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def client(first: asyncio.Event):
            outs = []
            while not answered.is_set():
                outs.append(await c.post("/v1/completions", json=body("hot")))
                first.set()
            return outs

        firsts = [asyncio.Event() for _ in range(3)]
        clients = [asyncio.ensure_future(client(f)) for f in firsts]
        await asyncio.gather(*(f.wait() for f in firsts))
        cold = await c.post("/v1/completions", json=body("cold"))
        answered.set()
        return cold, [r for outs in await asyncio.gather(*clients) for r in outs]


def pieces_of(response) -> list[str]:
    """The text of each token of a completion (its logprobs' tokens)."""
    return response.json()["choices"][0]["logprobs"]["tokens"]
