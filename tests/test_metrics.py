"""/metrics on a real server on 127.0.0.1 (in process where no model is needed): request, token, latency, adapter,
memory and HTTP series move as requests are answered, and the route can be
put behind the API key (mola/server/metrics.py)."""

from __future__ import annotations

import re

import httpx

from helpers.scripted import InProcessServer, tokenizer_model
from helpers.servers import start_server

API = "api-key-123456"


def chat(model="tiny", **extra):
    return {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, **extra}


def test_metrics(server):
    before = httpx.get(server.url + "/metrics").text
    for model in ("tiny", "a", "a"):
        assert httpx.post(server.url + "/v1/chat/completions", json=chat(model, ignore_eos=True)).status_code == 200
    text = httpx.get(server.url + "/metrics").text

    def value(name, text=text):
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    assert value('mola_requests_total{model="a",outcome="length"}') - value(
        'mola_requests_total{model="a",outcome="length"}', before) == 2
    assert value('mola_generation_tokens_total{model="a"}') - value('mola_generation_tokens_total{model="a"}', before) == 8
    assert value("mola_time_to_first_token_seconds_count") >= 3
    assert value("mola_inter_token_latency_seconds_count") >= 9
    assert value("mola_adapters_resident") == server.state.registry.num_resident
    assert value("mola_adapter_slots") == server.state.registry.max_loras
    assert value("mola_adapter_loads_total") >= 3
    assert value("mola_memory_active_bytes") > 0 and value("mola_process_resident_bytes") > 0
    assert 'mola_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert value("mola_running_requests") == 0


def test_protected_metrics(tiny_model):
    handle = InProcessServer(tokenizer_model(tiny_model), api_key=API, protect_metrics=True)  # no port
    try:
        with handle.client() as c:
            assert c.get("/metrics").status_code == 401
            assert c.get("/health").status_code == 401
            assert c.get("/metrics", headers={"Authorization": f"Bearer {API}"}).status_code == 200
    finally:
        handle.stop()


def test_pack_bytes_follow_loads_and_unloads_in_health_and_metrics(tiny_model, adapters):
    """The slot packs' bytes, as /health (lora_packs) and /metrics report them,
    are what the packs hold now: nothing at start, the loaded adapter's
    modules at its rank, nothing again once it is unloaded."""
    from mola.adapters.formats import read_adapter

    handle = start_server(model=str(tiny_model), served_model_name="tiny", allow_any_adapter_path=True,
                          max_loras=4, max_lora_rank=64)
    try:
        def now():
            health = httpx.get(handle.url + "/health").json()["lora_packs"]["tiny"]
            text = httpx.get(handle.url + "/metrics").text
            m = re.search(r'^mola_lora_pack_bytes\{kind="dense"\} ([0-9.e+-]+)$', text, re.M)
            assert float(m.group(1)) == health["dense_bytes"], (m.group(1), health)
            return health

        geometry = handle.state.engine.geometry
        assert now()["bytes"] == 0
        assert httpx.post(handle.url + "/v1/adapters", json={"name": "b", "path": str(adapters["b"])}).status_code == 200
        handle.engine.call(lambda: None).result(timeout=30)  # the write has run
        loaded = now()
        assert loaded["bytes"] == geometry.pack_bytes([(8, read_adapter(adapters["b"]).modules)]) > 0
        assert loaded["ranks"] == [8] and loaded["slots"] == 2
        assert httpx.delete(handle.url + "/v1/adapters/b").status_code == 200
        handle.engine.call(lambda: None).result(timeout=30)  # the clear has run
        assert now()["bytes"] == 0 and now()["resizes"] >= 2  # (the idle engine may have compacted too)
    finally:
        handle.stop()
