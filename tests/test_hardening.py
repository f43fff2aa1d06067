"""Access control, backpressure, timeouts, request ids, and a dying engine
(mola/server/middleware.py, the frontend's admission; mola/engine/scheduler.py
expiry): the app's side in process over a scripted engine, the engine's own
expiry through a real server on 127.0.0.1. Metrics: tests/test_metrics.py."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from mola.config import AdapterSpec

from helpers.schemas import validate_schema
from helpers.scripted import InProcessServer, ScriptedEngine, tokenizer_model
from helpers.servers import start_server, wait_until

API, ADMIN = "api-key-123456", "admin-key-654321"
MSG = [{"role": "user", "content": "Hello there"}]


def chat(model="tiny", **extra):
    return {"model": model, "messages": MSG, "max_tokens": 4, **extra}


@pytest.fixture(scope="module")
def secured(tiny_model, adapters):
    """Keys are the protocol's: the app in process over a scripted engine (helpers/scripted.py)."""
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", api_key=API, admin_key=ADMIN,
                             adapters=(AdapterSpec("a", str(adapters["a"])),), allow_any_adapter_path=True,
                             max_loras=2, max_lora_rank=16)
    yield handle
    handle.stop()


def test_api_key_is_required_on_v1(secured):
    with secured.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong-key-000"}, {"Authorization": API}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401
            validate_schema("ErrorResponse", r.json())
            assert r.json()["error"]["type"] == "authentication_error"
            assert API not in r.text
        auth = {"Authorization": f"Bearer {API}"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.post("/v1/chat/completions", json=chat(), headers=auth).status_code == 200
        assert c.get("/health").status_code == 200  # open
        assert c.get("/metrics").status_code == 200  # open
    sdk = openai.OpenAI(base_url="http://mola/v1", api_key=API, max_retries=0, http_client=secured.client())
    assert sdk.chat.completions.create(model="a", messages=MSG, max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://mola/v1", api_key="nope-nope-nope", max_retries=0,
                      http_client=secured.client()).models.list()


def test_admin_key_guards_loads_and_unloads(secured, adapters):
    api = {"Authorization": f"Bearer {API}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    load = {"name": "b", "path": str(adapters["b"])}
    with secured.client() as c:
        assert c.post("/v1/adapters", json=load, headers=api).status_code == 401
        assert c.post("/v1/load_lora_adapter", headers=api,
                      json={"lora_name": "b", "lora_path": load["path"]}).status_code == 401
        assert c.post("/v1/adapters", json=load, headers=admin).status_code == 200
        assert c.get("/v1/adapters", headers=api).status_code == 200  # reading is not admin
        assert c.delete("/v1/adapters/b", headers=api).status_code == 401
        assert c.delete("/v1/adapters/b", headers=admin).status_code == 200


def test_request_ids(server):
    r = httpx.get(server.url + "/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(), headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


def test_queue_limit_answers_429(tiny_model):
    """Two rows and a queue of one: with three requests in flight (the scripted
    engine holds every step), a fourth is a 429 with Retry-After."""
    engine = ScriptedEngine()
    handle = InProcessServer(tokenizer_model(tiny_model), engine, max_num_seqs=2, max_queue=1)

    async def burst(c):
        engine.hold = asyncio.Event()
        inflight = [asyncio.ensure_future(c.post("/v1/chat/completions", json=chat(max_tokens=300, ignore_eos=True)))
                    for _ in range(3)]
        while len(engine.submitted) < 3:
            await asyncio.sleep(0)
        refused = await c.post("/v1/chat/completions", json=chat())
        engine.hold.set()
        return [(await r).status_code for r in inflight], refused

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=handle.app), base_url="http://mola") as c:
            return await burst(c)
    try:
        codes, r = handle.run(main())
        assert codes == [200, 200, 200] and r.status_code == 429
        assert r.headers["retry-after"] == "1"
        validate_schema("ErrorResponse", r.json())
        assert "--max-queue" in r.json()["error"]["message"]
    finally:
        handle.stop()


def test_request_timeout_cuts_a_running_request(tiny_model):
    """Event-driven, on any machine's speed: once the answer has begun, the
    engine thread is held until the request's deadline has passed; the row is
    cut at the next step, long before its 1,800 tokens."""
    handle = start_server(model=str(tiny_model), request_timeout=0.5)
    try:
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions",
                          json=chat(max_tokens=1800, ignore_eos=True, stream=True,
                                    stream_options={"include_usage": True})) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                next(lines), next(lines)  # the role, then the first token: the row runs
                past = time.monotonic() + 0.5 + 0.1  # the deadline was set before the first token
                handle.engine.call(lambda: time.sleep(max(0.0, past - time.monotonic()))).result(10)
                events = [json.loads(line[len("data: "):]) for line in lines if line != "data: [DONE]"]
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] == "length"
        assert 0 < events[-1]["usage"]["completion_tokens"] < 1800  # cut by the timeout
        # The cut row leaves the batch at the engine's next step: read that
        # from the snapshot the engine publishes, not from its scheduler.
        wait_until(lambda: (s := handle.engine.snapshot).num_running == s.num_waiting == s.num_prefilling == 0,
                   10, "the timed-out row to leave the batch")
    finally:
        handle.stop()


class DyingEngine(ScriptedEngine):
    """A scripted engine whose thread dies after its answer's first tokens."""

    def _step(self, seq, answer, i):
        if i == 2:
            self.is_alive, self.fail_with = False, "injected engine failure"
        return ScriptedEngine._step(seq, answer, i)


def test_dying_engine_turns_503_not_a_hang(tiny_model):
    """The app's side of a dying engine, in process: a stream under way ends
    with an error event and [DONE], /health turns 503, a new request is a 503."""
    loaded = tokenizer_model(tiny_model)
    word = loaded.tokenizer.encode(" sea", add_special_tokens=False)
    handle = InProcessServer(loaded, DyingEngine(lambda seq: word * 1500))
    try:
        with handle.client(timeout=30) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/chat/completions", json=chat(max_tokens=1500, ignore_eos=True, stream=True))
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert len(lines) >= 4  # the role and the first tokens came before the failure
            assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
            assert c.get("/health").status_code == 503
            r = c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        handle.stop()


def test_waiting_for_an_adapter_slot_counts_against_the_timeout(tiny_model, adapters):
    """The registry's wait for a slot, in process: with the only slot held, a
    request for another adapter ends by its timeout, a 503."""
    handle = InProcessServer(tokenizer_model(tiny_model), max_loras=1, max_lora_rank=16, request_timeout=0.3,
                             adapters=(AdapterSpec("a", str(adapters["a"])), AdapterSpec("b", str(adapters["b"]))))
    try:
        with handle.client(timeout=30) as c:
            # Hold a lease on "a", pinning the only slot, as a long request would.
            lease = handle.run(handle.state.registry.acquire("a"))
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=chat("b"))
            waited = time.monotonic() - t0
            # The slot is still held, so only the timeout can have ended the wait: no upper bound on a clock.
            assert r.status_code == 503 and "adapter slot" in r.json()["error"]["message"]
            assert waited > 0.25
            handle.loop.call_soon_threadsafe(lease.release)
            assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200
            assert handle.state.registry.get("b").waiting == 0
    finally:
        handle.stop()
