"""The host tier and prefetch, driven by the registry on a real engine and
loader: LRU eviction by count and by bytes that never drops an adapter with
requests running or waiting, versions that never share rows, reads started
while requests wait, read errors that reach exactly the waiters of their
adapter, and an engine that keeps decoding while the reader is busy
(mola/registry/host_tier.py, mola/registry/registry.py)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest

from mola.adapters.formats import read_adapter
from mola.adapters.recipe import SlotRecipe
from mola.engine.async_engine import AsyncEngine
from mola.engine.sequence import SamplingParams, Sequence
from mola.errors import InvalidAdapter
from mola.registry.host_tier import HostTier
from mola.registry.records import AdapterState
from mola.testing.adapter import make_random_adapter

from helpers.engines import run_registry
from helpers.references import greedy_tokens, merged_model
from helpers.servers import settle, start_server

S = AdapterState


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory):
    """Six rank-4 adapters of the same shape (so of the same size in host memory)."""
    root = tmp_path_factory.mktemp("tier")
    return [make_random_adapter(root / f"t{i}", tiny_model, rank=4, seed=300 + i) for i in range(6)]


def run(engine, scenario, tier=None):
    """Run ``scenario(registry)`` on a fresh registry of two slots over the engine."""
    run_registry(engine, scenario, max_loras=2, tier=tier)


def register_all(registry, paths):
    return [registry.register(f"t{i}", str(p), "rest") for i, p in enumerate(paths)]


async def slot_factors(engine, slot):
    """(A, scale * B) of every layer ``slot`` holds, copied out on the engine thread."""
    return await AsyncEngine(engine).call(lambda: {
        p: tuple(np.array(f) for f in layer.factors(slot))
        for p, layer in engine.packs.layers.items() if slot in layer.active_slots})


def test_lru_by_count_never_drops_pinned_adapters(engine, pool):
    async def scenario(registry):
        recs = register_all(registry, pool[:4])
        leases = []
        for r in recs[:2]:  # two slots, both busy
            leases.append(await registry.acquire(r.name))
        assert [r.cached for r in recs[:2]] == [True, True]
        waiters = [asyncio.ensure_future(registry.acquire(r.name)) for r in recs[2:]]
        await settle(lambda: recs[2].cached and recs[3].cached)  # prefetched while waiting
        tier = registry.tier
        assert len(tier) == 4 > tier.max_entries  # all four pinned: requests run on or wait for them
        assert recs[2].state is S.KNOWN and recs[3].state is S.KNOWN
        leases[0].release()  # t0 idle: its slot goes to t2, its rows may go
        lease2 = await waiters[0]
        assert recs[2].state is S.RESIDENT and recs[0].state is S.KNOWN
        assert len(tier) == 3 and not recs[0].cached  # t0: least recently used and unpinned
        leases[1].release()
        lease3 = await waiters[1]
        lease2.release(), lease3.release()
        assert len(tier) == 2 and {r.name for r in recs if r.cached} == {"t2", "t3"}
        assert (tier.stats.misses, tier.stats.hits, tier.stats.evictions) == (4, 0, 2)
        again = await registry.acquire("t2")  # resident still: no load at all
        again.release()
        # t0 again: rows from disk (a miss); t3, the least recently used, leaves the tier
        lease0 = await registry.acquire("t0")
        lease0.release()
        assert {r.name for r in recs if r.cached} == {"t0", "t2"} and tier.stats.misses == 5
    run(engine, scenario, tier=HostTier(max_entries=2))


def test_a_cached_adapter_loads_with_no_read(engine, pool):
    async def scenario(registry):
        recs = register_all(registry, pool[:3])
        for r in recs:  # three adapters through two slots, one after the other
            (await registry.acquire(r.name)).release()
        reads = registry.tier.stats.reads
        assert recs[0].state is S.KNOWN and recs[0].cached  # evicted from its slot, kept in host memory
        lease = await registry.acquire("t0")
        assert registry.tier.stats.reads == reads and registry.tier.stats.hits == 1
        factors = await slot_factors(engine, lease.slot)
        plain = read_adapter(pool[0])
        assert set(factors) == set(plain.modules)
        for path, (a, b) in factors.items():
            m = plain.modules[path]
            assert np.array_equal(a, np.array(m.a)) and np.allclose(b, m.scale * np.array(m.b), atol=1e-6)
        lease.release()
    run(engine, scenario, tier=HostTier(max_entries=8))


def test_byte_limit(engine, pool):
    async def scenario(registry):
        one = (await registry.loader.prepare(SlotRecipe.single(str(pool[5])))).host_bytes
        registry.tier.max_bytes = int(one * 2.5)  # room for two
        recs = register_all(registry, pool[:4])
        for r in recs:
            (await registry.acquire(r.name)).release()
        assert registry.tier.nbytes == 2 * one and {r.name for r in recs if r.cached} == {"t2", "t3"}
    run(engine, scenario, tier=HostTier(max_bytes=1 << 40))


def test_without_a_tier_rows_live_only_while_requests_wait(engine, pool):
    async def scenario(registry):
        recs = register_all(registry, pool[:3])
        held = [await registry.acquire(r.name) for r in recs[:2]]
        assert len(registry.tier) == 0 and not registry.tier.enabled
        waiter = asyncio.ensure_future(registry.acquire("t2"))
        await settle(lambda: recs[2].cached)  # prefetched, held for the waiting request
        held[0].release()
        (await waiter).release()
        held[1].release()
        assert len(registry.tier) == 0 and registry.tier.stats.hits == 0
    run(engine, scenario)


def test_a_new_version_never_serves_the_old_rows(engine, pool, tiny_model, tmp_path):
    path = tmp_path / "same-path"
    make_random_adapter(path, tiny_model, rank=4, seed=1)

    async def scenario(registry):
        v1 = await registry.load("x", str(path))
        assert v1.cached and v1.resident
        await registry.unload("x")
        assert not v1.cached and len(registry.tier) == 0
        make_random_adapter(path, tiny_model, rank=4, seed=2)  # the file changes under the same path
        v2 = await registry.load("x", str(path))
        lease = await registry.acquire("x")
        factors = await slot_factors(engine, lease.slot)
        plain = read_adapter(path)
        for p, (a, _) in factors.items():
            assert np.array_equal(a, np.array(plain.modules[p].a))
        assert v2.version == 2 and registry.tier.take(v1, count=False) is None
        lease.release()
    run(engine, scenario, tier=HostTier(max_entries=8))


def test_a_failed_read_reaches_its_waiters_and_nobody_else(engine, pool, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{")

    async def scenario(registry):
        good = register_all(registry, pool[:3])
        bad = registry.register("bad", str(broken), "rest")
        held = [await registry.acquire(r.name) for r in good[:2]]
        bad_waiters = [asyncio.ensure_future(registry.acquire("bad")) for _ in range(3)]
        good_waiter = asyncio.ensure_future(registry.acquire("t2"))
        results = await asyncio.gather(*bad_waiters, return_exceptions=True)
        assert all(isinstance(e, InvalidAdapter) and "not valid JSON" in e.message for e in results)
        assert registry.tier.stats.read_failures == 1  # one read for the three of them
        await settle(lambda: good[2].cached)
        assert not good_waiter.done()  # unharmed, still waiting for a slot
        held[0].release()
        (await good_waiter).release()
        with pytest.raises(InvalidAdapter):  # a later request reads again
            await registry.acquire("bad")
        assert registry.tier.stats.read_failures == 2 and bad.state is S.KNOWN
        held[1].release()
    run(engine, scenario, tier=HostTier(max_entries=8))


def test_waiters_of_one_adapter_share_one_read_and_one_load(engine, pool):
    async def scenario(registry):
        recs = register_all(registry, pool[:3])
        held = [await registry.acquire(r.name) for r in recs[:2]]
        loads, reads = registry.stats.loads, registry.tier.stats.reads
        waiters = [asyncio.ensure_future(registry.acquire("t2")) for _ in range(5)]
        await settle(lambda: recs[2].cached)
        held[0].release()
        leases = await asyncio.gather(*waiters)
        assert registry.stats.loads == loads + 1 and registry.tier.stats.reads == reads + 1
        assert recs[2].in_flight == 5 and len({lease.slot for lease in leases}) == 1
        for lease in (*leases, held[1]):
            lease.release()
    run(engine, scenario, tier=HostTier(max_entries=8))


def test_the_engine_decodes_while_the_reader_reads(engine, pool):
    """A read that cannot finish (the reader thread is held up) delays only
    the request that waits for it; the engine goes on decoding others."""
    async def scenario(registry):
        recs = register_all(registry, pool[:2])
        lease = await registry.acquire("t0")
        gate = threading.Event()
        blocker = registry.loader._reader.submit(gate.wait, 30)  # the reader thread is busy until the gate opens
        waiter = asyncio.ensure_future(registry.acquire("t1"))  # a free slot, but its read waits
        seq = Sequence(prompt=[1, 2, 3, 4], params=SamplingParams(max_tokens=12, temperature=0.0),
                       slot=lease.slot)
        tokens = [t async for out in AsyncEngine(engine).generate(seq) for t in out.tokens]
        assert len(tokens) == 12 and not waiter.done() and not recs[1].cached
        gate.set()
        blocker.result(timeout=10)
        (await waiter).release()
        lease.release()
    run(engine, scenario, tier=HostTier(max_entries=8))


def test_the_server_reports_the_tier_and_serves_new_versions(tiny_model, pool, tmp_path):
    """Through a server (2 slots, a host tier of 4): occupancy and hits in
    /v1/adapters and /metrics; an adapter reloaded from a rewritten file
    answers as the new file does, never from the old rows."""
    from mola.config import AdapterSpec

    path = tmp_path / "x"
    make_random_adapter(path, tiny_model, rank=4, seed=11)
    server = start_server(model=str(tiny_model), served_model_name="tiny", max_loras=2, max_lora_rank=16,
                          adapters=tuple(AdapterSpec(f"t{i}", str(p)) for i, p in enumerate(pool[:3])),
                          max_cpu_loras=4, allow_any_adapter_path=True)
    try:
        tok = server.state.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

        def ask(model):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        def reference(adapter):
            model, _ = merged_model(tiny_model, [adapter])
            return [tok.decode([t]) for t in greedy_tokens(model, prompt, 8)]

        # Read at start (t2 took t0's slot); then each request finds its
        # adapter out of a slot and in host memory: five loads, no read.
        for name in ("t0", "t1", "t2", "t0", "t1"):
            ask(name)
        listing = httpx.get(server.url + "/v1/adapters").json()
        tier = listing["host_tier"]
        assert tier["enabled"] and tier["entries"] == 3 and tier["max_entries"] == 4 and tier["bytes"] > 0
        assert (tier["hits"], tier["misses"], tier["reads"]) == (5, 0, 3)
        assert all(a["cached"] for a in listing["data"]) and listing["resident"] == 2
        metrics = httpx.get(server.url + "/metrics").text
        assert "mola_host_tier_hits_total 5.0" in metrics and "mola_host_tier_entries 3.0" in metrics

        assert httpx.post(server.url + "/v1/adapters", json={"name": "x", "path": str(path)}).status_code == 200
        assert ask("x") == reference(path)
        assert httpx.delete(server.url + "/v1/adapters/x").status_code == 200
        make_random_adapter(path, tiny_model, rank=4, seed=12)  # new weights, same path and name
        assert httpx.post(server.url + "/v1/adapters", json={"name": "x", "path": str(path)}).status_code == 200
        assert ask("x") == reference(path)
    finally:
        server.stop()
