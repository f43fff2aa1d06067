"""Faults and load, bounded in count and time: bad adapter loads under traffic
and load/unload cycles and memory on 127.0.0.1, concurrent loads through few
slots in process over a scripted engine (mola/registry/registry.py,
mola/adapters/loader.py)."""

from __future__ import annotations

import asyncio
import gc
import shutil

import httpx
import mlx.core as mx
import pytest

from mola.server.metrics import rss_bytes
from mola.testing.adapter import make_random_adapter

from helpers.scripted import ScriptedEngine, by_recipe, tokenizer_model
from helpers.scripted import client as inprocess_client

MSG = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def broken_adapters(adapters, tiny_model, tmp_path_factory):
    """One adapter of each broken kind, plus a missing path."""
    root = tmp_path_factory.mktemp("broken")
    good = adapters["a"]
    out = {"missing": root / "does-not-exist"}
    for kind in ("notjson", "shape", "rank", "truncated"):
        shutil.copytree(good, root / kind)
        out[kind] = root / kind
    (out["notjson"] / "adapter_config.json").write_text("{not json")
    t = mx.load(str(good / "adapters.safetensors"))
    key = next(iter(t))
    mx.save_safetensors(str(out["shape"] / "adapters.safetensors"), {**t, key: mx.zeros((5, 5))})
    big = make_random_adapter(root / "big", tiny_model, rank=32, seed=9)
    shutil.copy(big / "adapters.safetensors", out["rank"] / "adapters.safetensors")
    data = (good / "adapters.safetensors").read_bytes()
    (out["truncated"] / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    return out


def test_fifty_bad_loads_while_twenty_good_requests_run(server, broken_adapters):
    kinds = list(broken_adapters.items())
    before = {a["name"] for a in httpx.get(server.url + "/v1/adapters").json()["data"]}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            good = [c.post("/v1/chat/completions", json={"model": m, "messages": MSG, "max_tokens": 24,
                                                         "ignore_eos": True})
                    for m in ("a", "b", "c", "tiny") * 5]
            bad = [c.post("/v1/adapters", json={"name": f"bad{i}", "path": str(kinds[i % len(kinds)][1])})
                   for i in range(50)]
            return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = asyncio.run(asyncio.wait_for(go(), timeout=300))
    assert [r.status_code for r in good] == [200] * 20
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in good)
    for i, r in enumerate(bad):
        kind = kinds[i % len(kinds)][0]
        assert (r.status_code == 404) if kind == "missing" else (r.status_code == 400), (kind, r.text)
        assert r.json()["error"]["message"]
    after = {a["name"] for a in httpx.get(server.url + "/v1/adapters").json()["data"]}
    assert after == before


def test_ten_adapters_loaded_at_once_through_two_slots(tiny_model, tmp_path):
    """The registry's two slots under ten concurrent loads and uses, in process
    over a scripted engine whose answer names the files its slot holds."""
    paths = [make_random_adapter(tmp_path / f"ad{i}", tiny_model, rank=4, seed=200 + i) for i in range(10)]
    model = tokenizer_model(tiny_model)
    engine = ScriptedEngine()
    named = by_recipe(engine, model.tokenizer)
    engine.script = lambda seq: named(seq) * 12

    async def go():
        async with inprocess_client(model, engine, max_loras=2, max_lora_rank=8, allow_any_adapter_path=True) as c:
            loads = await asyncio.gather(*(c.post("/v1/adapters", json={"name": f"ad{i}", "path": str(p)})
                                           for i, p in enumerate(paths)))
            uses = await asyncio.gather(*(c.post("/v1/chat/completions", json={
                "model": f"ad{i}", "messages": MSG, "max_tokens": 12, "ignore_eos": True}) for i in range(10)))
            return loads, uses, c.state.registry

    loads, uses, registry = asyncio.run(asyncio.wait_for(go(), timeout=300))
    assert [r.status_code for r in loads] == [200] * 10
    assert [r.status_code for r in uses] == [200] * 10
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in uses)
    texts = {r.json()["choices"][0]["message"]["content"] for r in uses}
    assert len(texts) == 10  # each answered from a slot holding its own files
    assert registry.num_resident <= 2
    assert registry.stats.evictions >= 8


def test_hundred_load_unload_cycles_keep_memory_flat(server, adapters):
    """On the module's server (conftest's: adapters a, b and c resident, one
    slot free), a hundred cycles of load, answer, unload leave memory and the
    slots as they were."""
    registry = server.state.registry
    resident = registry.num_resident
    with httpx.Client(base_url=server.url, timeout=60) as c:
        def cycle(i):
            assert c.post("/v1/adapters", json={"name": f"cy{i}", "path": str(adapters["c"])}).status_code == 200
            assert c.post("/v1/chat/completions", json={"model": f"cy{i}", "messages": MSG,
                                                        "max_tokens": 2}).status_code == 200
            assert c.delete(f"/v1/adapters/cy{i}").status_code == 200

        for i in range(10):  # warm-up: allocator pools and caches settle
            cycle(i)
        gc.collect()
        rss0, active0 = rss_bytes(), mx.get_active_memory()
        for i in range(10, 110):
            cycle(i)
        gc.collect()
        rss1, active1 = rss_bytes(), mx.get_active_memory()
    assert active1 <= active0 * 1.05, (active0, active1)
    assert rss1 <= rss0 * 1.05, (rss0, rss1)
    assert registry.num_resident == resident
    assert not [r.name for r in registry.adapters() if r.name.startswith("cy")]
