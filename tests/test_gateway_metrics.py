"""The gauges Kubernetes' LoRA-aware routers read (mola/server/gateway_metrics.py),
parsed with prometheus-client's own text parser as the gateway's endpoint
picker parses them: the names and label sets of the model-server protocol
(gateway-api-inference-extension, proposal 003), adapters comma-separated,
and values that follow requests as they run and wait. In process, over the
scripted engine, with requests held in flight (no sleeps)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.scripted import ScriptedEngine, client, tokenizer_model

MSG = [{"role": "user", "content": "Hello there"}]
PROTOCOL = {  # name -> label names, as the protocol (and vLLM) give them
    "vllm:num_requests_running": {"model_name"},
    "vllm:num_requests_waiting": {"model_name"},
    "vllm:gpu_cache_usage_perc": {"model_name"},
    "vllm:kv_cache_usage_perc": {"model_name"},
    "vllm:lora_requests_info": {"max_lora", "running_lora_adapters", "waiting_lora_adapters"},
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tokenizer_model(tiny_model)


def scrape(text: str) -> dict[str, list]:
    """name -> its samples, as the picker reads them."""
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name in PROTOCOL}


def gauges(text: str) -> dict:
    """The protocol's gauges in plain values: counts by name, and the lora gauge's labels split on commas."""
    families = scrape(text)
    assert set(families) == set(PROTOCOL), sorted(families)
    out = {}
    for name, samples in families.items():
        assert len(samples) == 1, samples  # one series each: the default base
        assert set(samples[0].labels) == PROTOCOL[name], samples[0].labels
        out[name] = samples[0].value
    labels = families["vllm:lora_requests_info"][0].labels
    out["max_lora"] = int(labels["max_lora"])
    for side in ("running", "waiting"):
        value = labels[f"{side}_lora_adapters"]
        out[side] = value.split(",") if value else []
    return out


def test_gauges_follow_adapters_as_they_run_and_wait(model, adapters):
    """Two slots. Two requests on a and one on b run (held in the engine);
    a third adapter, c, must wait for a slot: running lists a and b, waiting
    c, the counts are 3 running and 1 waiting. Once they end, c has a slot,
    nothing runs or waits, and max_lora stays the slots."""
    engine = ScriptedEngine()
    engine.script = lambda seq: [7] * 3

    async def go():
        async with client(model, engine, max_loras=2, max_lora_rank=16, allow_any_adapter_path=True) as c:
            for name in "abc":
                assert (await c.post("/v1/adapters", json={"name": name, "path": str(adapters[name])})).status_code \
                    == 200
            idle = gauges((await c.get("/metrics")).text)
            engine.hold = asyncio.Event()
            posts = [asyncio.ensure_future(c.post("/v1/chat/completions", json={
                "model": m, "messages": MSG, "max_tokens": 3})) for m in ("a", "a", "b")]
            while len(engine.submitted) < 3:
                await asyncio.sleep(0)
            posts.append(asyncio.ensure_future(c.post("/v1/chat/completions", json={
                "model": "c", "messages": MSG, "max_tokens": 3})))
            while not c.state.registry.queue.ordered():  # c waits in line for a slot
                await asyncio.sleep(0)
            busy = gauges((await c.get("/metrics")).text)
            engine.hold.set()
            codes = [(await p).status_code for p in posts]
            return idle, busy, gauges((await c.get("/metrics")).text), codes

    idle, busy, after, codes = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert codes == [200] * 4
    assert busy["max_lora"] == idle["max_lora"] == after["max_lora"] == 2
    assert sorted(busy["running"]) == ["a", "b"] and busy["waiting"] == ["c"]
    assert busy["vllm:num_requests_running"] == 3 and busy["vllm:num_requests_waiting"] == 1
    assert "c" in after["running"] and len(after["running"]) == 2 and after["waiting"] == []
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert idle["waiting"] == [] and idle["vllm:num_requests_running"] == 0
    assert busy["vllm:lora_requests_info"] > 1.5e9  # a timestamp (seconds since the epoch), as vLLM sets it
    assert busy["vllm:gpu_cache_usage_perc"] == busy["vllm:kv_cache_usage_perc"] == 0  # no KV budget here


def test_lora_info_lists_only_names_a_router_can_send(model, adapters):
    """A stack built for a request holds a slot but is no ``model`` a router
    could send: the running list names its head adapter alone."""
    engine = ScriptedEngine()
    engine.script = lambda seq: [7]

    async def go():
        async with client(model, engine, max_loras=4, max_lora_rank=16, allow_any_adapter_path=True) as c:
            for name in "ab":
                await c.post("/v1/adapters", json={"name": name, "path": str(adapters[name])})
            r = await c.post("/v1/chat/completions", json={
                "model": "a", "messages": MSG, "max_tokens": 1, "adapters": [{"name": "b", "scale": 0.5}]})
            assert r.status_code == 200, r.text
            return gauges((await c.get("/metrics")).text), c.state.registry.num_resident

    seen, resident = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert resident == 3  # a, b and their stack
    assert seen["running"] == ["a", "b"]
