"""Replicas on Ray Serve (mola/ray/: deployments, app, launch), slow tier: a
local Ray cluster with two replicas of the tiny model, 8 adapters and 2 slots
a replica. Greedy answers equal a single server's; under a seeded Zipf load
the adapter loads summed over the replicas stay well under what round-robin
costs on the same sequence; killing one replica mid-stream fails only its
streams, with the dialect's error event (a Responses stream's response.failed,
its text what its deltas had said), and later requests are served;
streams and errors keep each dialect's shape.

Skipped (with the reason) when Ray is not installed or does not start within
its bounded tries; with MOLA_REQUIRE_RAY=1 (CI) that is a failure instead.
Every wait is bounded."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import httpx
import pytest

from helpers.schemas import sse_events, typed_events, validate_stream_event
from helpers.servers import free_port, start_server
from mola.config import AdapterSpec, ServeConfig
from mola.testing.adapter import make_random_adapter

pytestmark = pytest.mark.slow
REQUIRED = os.environ.get("MOLA_REQUIRE_RAY") == "1"
if not REQUIRED:
    pytest.importorskip("ray", reason="replicas need Ray Serve: pip install 'mola[ray]'")

NUM_ADAPTERS, SLOTS = 8, 2
MSG = [{"role": "user", "content": "Tell me about the sea"}]
REPLICA = "x-mola-replica"
ARRIVAL_S = 0.3  # seconds between the Zipf test's requests


def skip_or_fail(reason: str):
    if REQUIRED:
        pytest.fail(f"MOLA_REQUIRE_RAY=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def adapter_paths(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    return {f"ad{i}": make_random_adapter(root / f"ad{i}", tiny_model, rank=4, seed=300 + i)
            for i in range(NUM_ADAPTERS)}


@pytest.fixture(scope="module")
def settings(tiny_model, adapter_paths):
    return dict(model=str(tiny_model), served_model_name="tiny", max_loras=SLOTS, max_lora_rank=8,
                log_level="warning", adapters=tuple(AdapterSpec(n, str(p)) for n, p in adapter_paths.items()))


@pytest.fixture(scope="module")
def single(settings):
    handle = start_server(**{k: v for k, v in settings.items() if k != "log_level"})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def fleet(settings):
    """The Ray application's URL: Ray started in bounded tries, two replicas deployed."""
    from mola.ray.launch import RayStart, RayStartFailed, run_app, start_ray

    import ray

    env = {k: os.environ[k] for k in ("PYTHONPATH", "LD_PRELOAD") if k in os.environ}
    try:
        start_ray(RayStart(num_cpus=4, attempts=3, timeout=90, env=env))
        url = run_app(ServeConfig.from_settings(**settings), 2, replica_cpus=1, port=free_port(), timeout=300)
    except RayStartFailed as e:
        ray.shutdown()
        skip_or_fail(str(e))
    yield url
    ray.shutdown()  # the local cluster, replicas and all


def chat(model, **extra):
    return {"model": model, "messages": MSG, "max_tokens": 8, "temperature": 0, **extra}


def post(url, body, path="/v1/chat/completions"):
    return httpx.post(url + path, json=body, timeout=120)


def replica_loads(url) -> dict[str, float]:
    """Each replica's adapter loads (mola_adapter_loads_total), by its process
    id: /metrics through the ingress reaches a replica at random, so it is
    asked until both answered (2**-59 that 60 asks miss one)."""
    seen: dict[str, float] = {}
    for _ in range(60):
        r = httpx.get(url + "/metrics", timeout=60)
        m = re.search(r"^mola_adapter_loads_total ([0-9.e+]+)$", r.text, re.M)
        seen[r.headers[REPLICA]] = float(m.group(1))
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only replicas {sorted(seen)} answered /metrics")


def lru_loads(sequence: list[str], replicas: int, slots: int) -> int:
    """Loads of round-robin routing: request i to replica i % replicas, each
    replica a least-recently-used set of ``slots`` adapters (the registry's
    eviction when requests come one at a time)."""
    held: list[list[str]] = [[] for _ in range(replicas)]
    loads = 0
    for i, name in enumerate(sequence):
        lru = held[i % replicas]
        if name in lru:
            lru.remove(name)
        else:
            loads += 1
            if len(lru) == slots:
                lru.pop(0)
        lru.append(name)
    return loads


def zipf(n: int, names: list[str], s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    return rng.choices(names, weights=[1 / (k + 1) ** s for k in range(len(names))], k=n)


def test_lru_loads_counts_misses():
    assert lru_loads(["a", "b", "a", "b"], 1, 2) == 2
    assert lru_loads(["a", "b", "c", "a"], 1, 2) == 4
    assert lru_loads(["a", "a", "a", "a"], 2, 1) == 2  # each replica loads it once


def test_greedy_answers_equal_the_single_servers(fleet, single, adapter_paths):
    for model in ["tiny", *adapter_paths]:
        mine, ref = post(fleet, chat(model)), post(single.url, chat(model))
        assert mine.status_code == ref.status_code == 200, mine.text
        assert mine.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"], model


def test_affinity_loads_stay_well_under_round_robin(fleet, adapter_paths):
    """60 requests, Zipf (s=1.5) over the 8 adapters, arriving one every
    ARRIVAL_S: longer than the 0.1 s in which a replica tells Ray's router the
    ids it holds. (A burst, one request straight after another, routes partly
    on stale ids: 26 to 28 loads where this gets ~19; docs/distributed.md.)
    Round-robin on the same sequence loads 32 times; Ray's choice (a holder,
    else either replica at random) loads 15 times at the median of 5,000
    simulated runs, 24 at the worst, 25 at the worst with one request of
    staleness: the bound, 0.8 of round-robin's, is not reached by chance."""
    sequence = zipf(60, sorted(adapter_paths), 1.5, seed=47)
    before = replica_loads(fleet)
    for name in sequence:
        assert post(fleet, chat(name, max_tokens=2)).status_code == 200
        time.sleep(ARRIVAL_S)  # the arrival rate: this test is about real time
    after = replica_loads(fleet)
    loads = sum(after.values()) - sum(before.values())
    baseline = lru_loads(sequence, 2, SLOTS)
    print(f"adapter loads over 60 Zipf requests: {loads:.0f} with Ray's affinity, {baseline} round-robin")
    assert baseline == 32  # the sequence is seeded
    assert loads <= 0.8 * baseline, (loads, baseline)


def test_streams_and_errors_keep_their_shape(fleet, single):
    for path, body in (("/v1/chat/completions", chat("ad1", stream=True)),
                       ("/v1/completions", {"model": "ad2", "prompt": "The sea", "max_tokens": 6, "temperature": 0,
                                            "stream": True})):
        mine, ref = post(fleet, body, path), post(single.url, body, path)
        assert mine.headers["content-type"] == ref.headers["content-type"]
        a, b = sse_events(mine.text), sse_events(ref.text)
        assert a[-1] == b[-1] == "[DONE]" and len(a) == len(b)
        assert [sorted(e) for e in a[:-1]] == [sorted(e) for e in b[:-1]]
        assert [e["choices"] for e in a[:-1]] == [e["choices"] for e in b[:-1]]
    for path, body in (("/v1/chat/completions", chat("nope")), ("/v1/messages", {"model": "nope", "max_tokens": 4,
                                                                                  "messages": MSG})):
        mine, ref = post(fleet, body, path), post(single.url, body, path)
        assert mine.status_code == ref.status_code == 404
        mine, ref = mine.json(), ref.json()
        assert mine.pop("request_id", None) is not None or "error" in mine  # (Anthropic's envelope has one)
        ref.pop("request_id", None)
        assert mine == ref
    bad = httpx.post(fleet + "/v1/chat/completions", content=b"{nope", timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"]


def test_a_replica_killed_mid_stream_fails_only_its_requests(fleet, adapter_paths):
    """Long streams on several adapters until both replicas hold one (the
    first a Responses stream, the rest chat's); the first stream's replica is
    killed after each stream's first event: its streams end with the error
    event (the Responses stream with response.failed), the other's finish
    with [DONE], and requests afterwards are answered."""
    body = {"messages": MSG, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    responses = {"input": MSG[0]["content"], "max_output_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        streams = []
        for i, name in enumerate(sorted(adapter_paths)):
            path, payload = ("/v1/responses", responses) if i == 0 else ("/v1/chat/completions", body)
            s = c.send(c.build_request("POST", fleet + path, json={**payload, "model": name}), stream=True)
            lines = s.iter_lines()
            first = next(line for line in lines if line)
            streams.append((s, lines, first))
            if len({s.headers[REPLICA] for s, _, _ in streams}) == 2:
                break
        pids = {s.headers[REPLICA] for s, _, _ in streams}
        assert len(pids) == 2, "the ingress sent every adapter to one replica"
        victim = streams[0][0].headers[REPLICA]
        os.kill(int(victim), signal.SIGKILL)
        for s, lines, first in streams:
            text = "\n".join([first, *lines]) + "\n"
            s.close()
            if s.url.path == "/v1/responses":  # on the victim: ended as mola ends a failed response
                events = typed_events(text)
                validate_stream_event(events[-1])
                assert events[-1]["type"] == "response.failed", events[-1]
                assert events[-1]["response"]["status"] == "failed"
                assert events[-1]["sequence_number"] == events[-2]["sequence_number"] + 1
                said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
                items = events[-1]["response"]["output"]  # the text its deltas had carried when it was cut
                assert "".join(p["text"] for i in items for p in i.get("content", ())) == said
                continue
            events = sse_events(text)
            if s.headers[REPLICA] == victim:
                assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "engine_unavailable", events[-1]
                assert len(events) >= 2  # the stream had begun: it failed part-way
            else:
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    after = [post(fleet, chat(name, max_tokens=2)) for name in sorted(adapter_paths)[:4]]
    assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
