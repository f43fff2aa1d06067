"""Residency, just-in-time loads, LRU eviction, draining unloads, versions,
adapter sources and vLLM's endpoints, through a real server on 127.0.0.1
(mola/registry/registry.py, mola/registry/sources.py, mola/server/routes/)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading

import httpx
import mlx.core as mx
import pytest

from mola.config import AdapterSpec
from mola.testing.adapter import make_random_adapter

from helpers.engines import runner_stats
from helpers.references import greedy_tokens, merged_model
from helpers.servers import start_server, wait_until

MAX_TOKENS = 8
QUESTION = "Tell me about the sea."
KEYS = [("self_attn.q_proj", "self_attn.v_proj"), ("mlp.down_proj",), ("self_attn.o_proj", "mlp.up_proj"),
        ("self_attn.k_proj", "self_attn.q_proj", "mlp.gate_proj")]


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory):
    """16 adapters of ranks 2-16 and various targets: 8 named at start, 8 in an adapter dir."""
    root = tmp_path_factory.mktemp("pool")
    named, in_dir = {}, {}
    for i in range(16):
        target = (root / "named" if i < 8 else root / "dir") / f"p{i}"
        make_random_adapter(target, tiny_model, rank=2 + (i % 8) * 2, keys=KEYS[i % 4],
                            num_layers=1 + i % 2, seed=50 + i)
        (named if i < 8 else in_dir)[f"p{i}"] = target
    return {"root": root, "named": named, "dir": in_dir, "all": {**named, **in_dir}}


@pytest.fixture(scope="module")
def server(tiny_model, pool):
    handle = start_server(
        model=str(tiny_model),
        served_model_name="tiny",
        adapters=tuple(AdapterSpec(n, str(p)) for n, p in pool["named"].items()),
        adapter_dirs=(str(pool["root"] / "dir"),),
        max_loras=4,
        max_lora_rank=16,
    )
    yield handle
    handle.stop()


def body(model, **extra):
    return {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def reference_text(server, model_dir, adapter_dirs, max_tokens=MAX_TOKENS, ignore_eos=False):
    model, _ = merged_model(model_dir, adapter_dirs)
    tok = server.state.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    tokens = greedy_tokens(model, prompt, max_tokens)
    eos = set(tok.eos_token_ids)
    special = eos | {i for i, t in tok.added_tokens_decoder.items() if t.special}  # skip_special_tokens
    detok = tok.detokenizer
    for t in tokens:
        if t in eos and not ignore_eos:
            break
        if t not in special:
            detok.add_token(t)
    detok.finalize()
    return detok.text


def adapters_state(client) -> dict[str, dict]:
    return {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}


def burst(url, bodies):
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
    return asyncio.run(go())


def test_every_known_adapter_is_listed(client, pool):
    ids = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert ids == {"tiny", *pool["all"]}
    state = adapters_state(client)
    assert sum(a["resident"] for a in state.values()) == 4  # max_loras
    assert all(state[n]["source"] == "dir" and not state[n]["resident"] for n in pool["dir"])


def test_sixteen_adapters_through_four_slots(server, client, pool, tiny_model):
    """Requests for 16 adapters (and the base) at once through 4 slots: all
    succeed, each answer is its own adapter's, residency never exceeds 4."""
    expected = {n: reference_text(server, tiny_model, [p]) for n, p in pool["all"].items()}
    expected["tiny"] = reference_text(server, tiny_model, [])
    assert len(set(expected.values())) == 17
    stats = server.state.registry.stats
    evictions = stats.evictions
    peak = []
    stop = threading.Event()

    def watch():  # samples residency while the burst runs, every 2 ms
        while not stop.is_set():
            peak.append(server.state.registry.num_resident)
            stop.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        names = [*pool["all"], "tiny"] * 3
        resps = burst(server.url, [body(n) for n in names])
    finally:
        stop.set()
        watcher.join()
    for name, r in zip(names, resps):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected[name], name
    assert max(peak) <= 4
    assert stats.evictions - evictions >= 12
    assert runner_stats(server.engine).max_slots_in_step >= 3  # mixed ranks/targets in one step


def test_lru_eviction_picks_the_least_recently_used_idle_adapter(client):
    for name in ("p0", "p1", "p2", "p3"):
        assert client.post("/v1/chat/completions", json=body(name)).status_code == 200
    assert {n for n, a in adapters_state(client).items() if a["resident"]} == {"p0", "p1", "p2", "p3"}
    client.post("/v1/chat/completions", json=body("p0"))  # p1 is now the least recently used
    assert client.post("/v1/chat/completions", json=body("p9")).status_code == 200
    assert {n for n, a in adapters_state(client).items() if a["resident"]} == {"p0", "p2", "p3", "p9"}


def test_request_waits_when_every_slot_is_busy(server, client):
    """Four long requests pin all four slots; a request for a fifth adapter
    waits in the queue and succeeds once a slot frees."""
    long = [body(f"p{i}", max_tokens=250, ignore_eos=True) for i in (4, 5, 6, 7)]
    results = {}

    def run_long():
        results["long"] = burst(server.url, long)

    t = threading.Thread(target=run_long)
    t.start()
    wait_until(lambda: sum(a["in_flight"] > 0 for a in adapters_state(client).values()) == 4, 10,
               "the four long requests to hold the four slots")
    r = client.post("/v1/chat/completions", json=body("p10"))
    t.join()
    assert r.status_code == 200
    assert all(x.status_code == 200 and x.json()["usage"]["completion_tokens"] == 250
               for x in results["long"])


def test_unload_then_rediscovery_is_refused_until_loaded_again(client, pool):
    assert client.post("/v1/chat/completions", json=body("p12")).status_code == 200
    assert client.delete("/v1/adapters/p12").status_code == 200
    r = client.post("/v1/chat/completions", json=body("p12"))
    assert r.status_code == 404  # still in the adapter dir, but unloaded
    assert client.post("/v1/adapters", json={"name": "p12", "path": str(pool["dir"]["p12"])}).status_code == 200
    assert client.post("/v1/chat/completions", json=body("p12")).status_code == 200


def test_entry_added_to_adapter_dir_later_is_found(client, pool, tiny_model, server):
    new = pool["root"] / "dir" / "late"
    make_random_adapter(new, tiny_model, rank=4, seed=999)
    try:
        r = client.post("/v1/chat/completions", json=body("late"))
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == reference_text(server, tiny_model, [new])
        assert client.get("/v1/models/late").json()["parent"] == "tiny"
    finally:
        client.delete("/v1/adapters/late")
        shutil.rmtree(new)
    assert client.post("/v1/chat/completions", json=body("no-such-entry")).status_code == 404
    assert client.post("/v1/chat/completions", json=body("../named/p0")).status_code == 404


def test_paths_outside_the_allowed_roots_are_refused(client, pool, tmp_path, tiny_model):
    outside = make_random_adapter(tmp_path / "outside", tiny_model, rank=2, seed=7)
    r = client.post("/v1/adapters", json={"name": "x", "path": str(outside)})
    assert r.status_code == 403 and "--adapter-dir" in r.json()["error"]["message"]
    link = pool["root"] / "dir" / "sneaky"
    os.symlink(outside, link)
    try:  # inside the dir by name, outside after symlinks
        r = client.post("/v1/adapters", json={"name": "x", "path": str(link)})
        assert r.status_code == 403
    finally:
        link.unlink()
    # A path named at start may be loaded again under another name.
    r = client.post("/v1/adapters", json={"name": "again", "path": str(pool["named"]["p1"])})
    assert r.status_code == 200
    client.delete("/v1/adapters/again")
    assert "x" not in adapters_state(client)


def test_reload_is_a_new_version_and_old_requests_finish_on_old_weights(server, client, pool, tiny_model):
    a, b = pool["dir"]["p8"], pool["dir"]["p9"]
    client.post("/v1/adapters", json={"name": "ver", "path": str(a)})
    old_text = reference_text(server, tiny_model, [a], max_tokens=200, ignore_eos=True)
    new_text = reference_text(server, tiny_model, [b])
    results = {}

    def old_request():
        results["old"] = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                                    json=body("ver", max_tokens=200, ignore_eos=True))

    t = threading.Thread(target=old_request)
    t.start()
    wait_until(lambda: adapters_state(client)["ver"]["in_flight"], 10, "the old version's request to run")
    assert client.delete("/v1/adapters/ver").json()["in_flight"] == 1
    r = client.post("/v1/adapters", json={"name": "ver", "path": str(b)})
    assert r.status_code == 200 and r.json()["version"] == 2
    new = client.post("/v1/chat/completions", json=body("ver"))
    t.join()
    assert new.json()["choices"][0]["message"]["content"] == new_text
    assert results["old"].json()["choices"][0]["message"]["content"] == old_text
    client.delete("/v1/adapters/ver")


def test_load_unload_cycles_return_memory(server, client, pool):
    path = str(pool["named"]["p7"])

    def cycle(i):
        assert client.post("/v1/adapters", json={"name": f"cyc{i}", "path": path}).status_code == 200
        assert client.post("/v1/chat/completions", json=body(f"cyc{i}")).status_code == 200
        assert client.delete(f"/v1/adapters/cyc{i}").status_code == 200

    def settled():  # every engine command queued so far (the slot clears) has run
        server.engine.call(lambda: None).result(timeout=30)
        mx.clear_cache()

    for i in range(5):  # warm up caches
        cycle(i)
    settled()
    before = mx.get_active_memory()
    for i in range(5, 45):
        cycle(i)
    settled()
    after = mx.get_active_memory()
    assert after <= before * 1.05 + (1 << 16), (before, after)


def test_vllm_endpoints(client, pool, tmp_path):
    path = str(pool["dir"]["p14"])
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "vl", "lora_path": path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'vl' added successfully."
    assert client.post("/v1/chat/completions", json=body("vl")).status_code == 200
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "vl", "lora_path": path})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = client.post("/v1/load_lora_adapter",
                    json={"lora_name": "v2", "lora_path": str(pool["root"] / "dir" / "missing")})
    assert r.status_code == 404
    broken = pool["root"] / "dir" / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("[]")
    try:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "v3", "lora_path": str(broken)})
        assert r.status_code == 400
    finally:
        shutil.rmtree(broken)
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "vl"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'vl' removed successfully."
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "vl"}).status_code == 404
    assert client.post("/v1/chat/completions", json=body("vl")).status_code == 404


def test_bad_loads_under_traffic_harm_nobody(server, client, pool, tiny_model, tmp_path):
    """Bad adapters of every kind, loaded while good requests run: each gets a
    4xx naming its problem, every good request succeeds with its own answer."""
    good = pool["dir"]["p13"]
    root = pool["root"] / "dir"
    bad = {}
    for kind in ("notjson", "rank", "shape", "nan", "truncated", "unknown_module"):
        p = root / f"bad-{kind}"
        shutil.copytree(good, p)
        bad[kind] = p
    (bad["notjson"] / "adapter_config.json").write_text("{")
    big = make_random_adapter(tmp_path / "big", tiny_model, rank=32, seed=1)
    shutil.copy(big / "adapters.safetensors", bad["rank"] / "adapters.safetensors")
    t = mx.load(str(good / "adapters.safetensors"))
    k = next(iter(t))
    mx.save_safetensors(str(bad["shape"] / "adapters.safetensors"), {**t, k: mx.zeros((3, 3))})
    mx.save_safetensors(str(bad["nan"] / "adapters.safetensors"), {**t, k: t[k] * float("nan")})
    data = (good / "adapters.safetensors").read_bytes()
    (bad["truncated"] / "adapters.safetensors").write_bytes(data[: len(data) // 3])
    kk = k.replace("layers.", "layers.7")
    mx.save_safetensors(str(bad["unknown_module"] / "adapters.safetensors"), {**t, kk: t[k]})
    expected = reference_text(server, tiny_model, [good])

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            goods = [c.post("/v1/chat/completions", json=body("p13")) for _ in range(12)]
            bads = [c.post("/v1/adapters", json={"name": f"b-{kind}-{i}", "path": str(p)})
                    for i in range(3) for kind, p in bad.items()]
            bads.append(c.post("/v1/adapters", json={"name": "b-missing", "path": str(root / "nope")}))
            return await asyncio.gather(*goods), await asyncio.gather(*bads)

    goods, bads = asyncio.run(go())
    for r in goods:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
    for r in bads:
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["message"]
    messages = [r.json()["error"]["message"] for r in bads]
    assert any("not valid JSON" in m for m in messages)
    assert any("--max-lora-rank" in m for m in messages)
    assert any("non-finite" in m for m in messages)
    assert any("do not fit" in m for m in messages)
    assert any("does not exist" in m for m in messages)
    assert not any(n.startswith("b-") for n in adapters_state(client))
    for p in bad.values():
        shutil.rmtree(p)


def test_default_scale_of_an_adapter(server, client, pool, tiny_model):
    path = pool["named"]["p3"]
    assert client.post("/v1/adapters", json={"name": "half", "path": str(path), "scale": 0.5}).status_code == 200
    model, _ = merged_model(tiny_model, [path], scales=[0.5])
    tok = server.state.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    detok = tok.detokenizer
    for t in greedy_tokens(model, prompt, MAX_TOKENS):
        if t in tok.eos_token_ids:
            break
        if not (t in tok.added_tokens_decoder and tok.added_tokens_decoder[t].special):
            detok.add_token(t)
    detok.finalize()
    r = client.post("/v1/chat/completions", json=body("half"))
    assert r.json()["choices"][0]["message"]["content"] == detok.text
    assert detok.text != reference_text(server, tiny_model, [path])
    client.delete("/v1/adapters/half")
