"""Serving a sharded base over 2 ranks (mlx.launch, ring backend, loopback):
the same outputs as one process, hot loads and unloads in order with the
batch, and a dead rank answered with 503s, not a hang
(mola/engine/distributed.py, the shard-aware MultiLoRALinear)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from mola.engine.distributed import HEARTBEAT_SECONDS, SHARE_TIMEOUT_SECONDS
from mola.testing.adapter import make_random_adapter
from mola.testing.model import TinyModelSpec, make_tiny_model

from helpers.servers import free_port, settle, status_is, wait_healthy, wait_until

pytestmark = [
    pytest.mark.slow,  # process groups end to end: CI's second tier (pytest -m slow)
    pytest.mark.skipif(shutil.which("mlx.launch") is None or not sys.platform.startswith("linux"),
                       reason="needs mlx.launch, and /proc to find the ranks"),
]

QUESTIONS = ["Hello there", "What is the capital of France?", "Tell me a story about the sea"]
KEYS = [("self_attn.q_proj", "self_attn.o_proj"), ("mlp.down_proj", "mlp.up_proj", "self_attn.v_proj"),
        ("self_attn.k_proj", "mlp.gate_proj", "self_attn.o_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    # 4 heads / 2 kv heads / 128-wide MLP: every sharded dimension splits in two.
    model = make_tiny_model(root / "model", TinyModelSpec())
    adapters = {f"d{i}": make_random_adapter(root / f"d{i}", model, rank=2 + 2 * i, keys=KEYS[i],
                                             num_layers=1 + i % 2, seed=70 + i) for i in range(3)}
    return model, adapters


def launch(args: list[str], distributed: bool):
    port = free_port()
    serve = [sys.executable, "-m", "mola", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning", *args]
    if distributed:
        cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "--", *serve, "--distributed"]
    else:
        cmd = serve
    env = {**os.environ, "MOLA_OPENBLAS": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 180, lambda: kill(proc))
    return proc, url


def kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


def answers(url, models):
    """Greedy answers of every model to every question, free and under a
    json_schema (each rank keeps its own matchers), all in one batch."""
    def request(m, q, constrained):
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
                 "max_tokens": 40} if constrained else {"ignore_eos": True}
        return {"model": m, "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                "temperature": 0, **extra}

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            jobs = [(m, q, k) for q in QUESTIONS for m in models for k in (False, True)]
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=request(*job)) for job in jobs))
            out = {job: r.json()["choices"][0]["message"]["content"] for job, r in zip(jobs, rs)}
            for (m, q, constrained), r in zip(jobs, rs):
                if constrained and r.json()["choices"][0]["finish_reason"] == "stop":
                    assert set(json.loads(out[m, q, constrained])) == {"ok", "n"}
            return out
    return asyncio.run(go())


LOOKUP_PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat sat",
                  "one two three four one two three four one two three"]


def lookup_answers(url, models):
    """Greedy completions of prompts whose ends occurred before in them
    (prompt lookup drafts from the first step), every model in one batch."""
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            jobs = [(m, p) for p in LOOKUP_PROMPTS for m in models]
            bodies = [{"model": m, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                      for m, p in jobs]
            rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
            return {job: r.json()["choices"][0]["text"] for job, r in zip(jobs, rs)}
    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference(setup):
    """One process's answers: to answers() and to lookup_answers()."""
    model, adapters = setup
    proc, url = launch(["--model", str(model), "--allow-any-adapter-path", "--max-lora-rank", "16",
                        *sum((["--adapter", f"{n}={p}"] for n, p in adapters.items()), [])], False)
    try:
        yield answers(url, ["model", *adapters]), lookup_answers(url, ["model", *adapters])
    finally:
        kill(proc)


@pytest.fixture(scope="module")
def single(reference):
    return reference[0]


@pytest.fixture(scope="module")
def group(setup):
    model, adapters = setup
    proc, url = launch(["--model", str(model), "--allow-any-adapter-path", "--max-lora-rank", "16",
                        "--adapter", f"d0={adapters['d0']}"], True)
    yield proc, url, adapters
    kill(proc)


def test_two_ranks_answer_like_one_process(group, single):
    proc, url, adapters = group
    for name in ("d1", "d2"):  # hot-loaded: reaches both ranks
        assert httpx.post(url + "/v1/adapters", json={"name": name, "path": str(adapters[name])}).status_code == 200
    got = answers(url, ["model", *adapters])  # base and three adapters, mixed in one batch
    assert got == single
    free = [v for (_, _, constrained), v in got.items() if not constrained]
    assert len(set(free)) == len(free)  # every model id answered differently


def test_hot_load_and_unload_during_traffic(group, single, setup):
    proc, url, adapters = group
    model, _ = setup
    extra = make_random_adapter(model.parent / "hot", model, rank=8, seed=99)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            async def ask(m):
                return await c.post("/v1/chat/completions", json={
                    "model": m, "messages": [{"role": "user", "content": QUESTIONS[1]}],
                    "max_tokens": 40, "temperature": 0, "ignore_eos": True})

            traffic = [asyncio.ensure_future(ask(m)) for m in ("model", "d0", "d1", "d2") * 3]

            async def running():  # requests on the adapters, as the server counts them
                return sum(a["in_flight"] for a in (await c.get("/v1/adapters")).json()["data"])

            await settle(running, 60, every=0.05)  # the traffic runs
            load = await c.post("/v1/adapters", json={"name": "hot", "path": str(extra)})
            hot = await ask("hot")
            unload = await c.delete("/v1/adapters/d1")
            return await asyncio.gather(*traffic), load, hot, unload

    traffic, load, hot, unload = asyncio.run(go())
    assert load.status_code == 200 and hot.status_code == 200 and unload.status_code == 200
    assert all(r.status_code == 200 for r in traffic)
    by_model = {}
    for r in traffic:
        by_model.setdefault(r.json()["model"], set()).add(r.json()["choices"][0]["message"]["content"])
    assert all(len(v) == 1 for v in by_model.values())  # no request saw a mixed-up slot
    assert httpx.post(url + "/v1/chat/completions", json={
        "model": "d1", "messages": [{"role": "user", "content": "x"}]}).status_code == 404
    # The base and the remaining adapters still answer exactly as one process does,
    # from prompt-cache entries that both ranks hold (rank 0 decides, the other follows).
    before = httpx.get(url + "/v1/adapters").json()["prompt_cache"]
    assert answers(url, ["model", "d0", "d2"]) == {k: v for k, v in single.items() if k[0] != "d1"}
    after = httpx.get(url + "/v1/adapters").json()["prompt_cache"]
    assert after["hits"] >= before["hits"] + 3 * len(QUESTIONS)


def test_a_gguf_base_shards_like_its_mlx_lm_twin(setup, single):
    """The GGUF twin of the model (mola.testing.gguf_model), loaded on each rank and
    sharded with mlx-lm's own model.shard, answers as one process on the directory."""
    from mola.testing.gguf_model import save_gguf_model

    model, adapters = setup
    gguf = save_gguf_model(model.parent / "model.gguf", model)
    proc, url = launch(["--model", str(gguf), "--served-model-name", "model", "--allow-any-adapter-path",
                        "--max-lora-rank", "16", "--adapter", f"d0={adapters['d0']}",
                        "--adapter", f"d2={adapters['d2']}"], True)
    try:
        got = answers(url, ["model", "d0", "d2"])
    finally:
        kill(proc)
    assert got == {k: v for k, v in single.items() if k[0] in ("model", "d0", "d2")}


def test_two_ranks_speculate_like_one_process(setup, reference):
    """With a draft model (each rank holds a whole copy, which drafts the
    same tokens on every rank), the followers verify the same drafts and cut
    their caches alike: the answers are one process's without speculation.
    (Prompt lookup's drafts travel in the plan: see test_a_plan_with_drafts_travels_whole.)"""
    model, adapters = setup
    flags = ["--speculative", "draft", "--draft-model", str(model), "--speculate-always",
             "--speculative-max-batch", "32"]
    proc, url = launch(["--model", str(model), "--allow-any-adapter-path", "--max-lora-rank", "16", *flags,
                        *sum((["--adapter", f"{n}={p}"] for n, p in adapters.items()), [])], True)
    try:
        models = ["model", *adapters]
        assert lookup_answers(url, models) == reference[1]
        assert answers(url, models) == reference[0]
        metrics = httpx.get(url + "/metrics").text
        drafted = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("mola_speculative_draft_tokens_total"))
        assert drafted > 0
    finally:
        kill(proc)


def test_a_plan_with_drafts_travels_whole():
    """A speculative plan on the wire: the followers get the drafts and
    counts rank 0 verifies, with their own Sequence objects."""
    from mola.engine.config import SpeculativeConfig
    from mola.engine.distributed import unwire_plan, wire_plan
    from mola.engine.scheduler import Scheduler
    from mola.engine.sequence import SamplingParams, Sequence
    from mola.engine.speculative import Speculator

    s = Scheduler(speculator=Speculator(SpeculativeConfig()))
    for i, prompt in enumerate(([1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7])):
        s.add(Sequence(prompt=prompt, params=SamplingParams(max_tokens=9), seq_id=i))
    plan = s.schedule()
    assert plan.proposal.num_draft == [4, 0]
    seqs: dict = {}
    again = unwire_plan(pickle.loads(pickle.dumps(wire_plan(plan))), seqs)
    assert again.proposal == plan.proposal and again.proposal.tokens == [[4, 5, 1, 2], []]
    assert [q.seq_id for q in again.decode] == [q.seq_id for q in plan.decode]
    assert again.decode[0] is seqs[plan.decode[0].seq_id]


def start_ranks(model, tmp_path) -> tuple[list[subprocess.Popen], str]:
    """The two ranks started by hand, as mlx.launch starts them (a ring
    hostfile and MLX_RANK), but with no launcher to tear the group down.
    Their output goes to rank0.log and rank1.log in tmp_path."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MOLA_OPENBLAS": "0", "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mola", "serve", "--distributed", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            env=env, stdout=(tmp_path / f"rank{rank}.log").open("w"), stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert all(p.poll() is None for p in procs), f"ranks did not start:\n{rank_logs(tmp_path)}"
        return status_is(url + "/health", 200)

    try:
        wait_until(healthy, 180, "the ranks to start", every=0.3)
    except TimeoutError as e:
        raise AssertionError(f"{e}:\n{rank_logs(tmp_path)}") from None
    return procs, url


def rank_logs(tmp_path) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))


def wait_for_health(url: str, status: int, within: float, tmp_path) -> float:
    """Seconds until /health answers ``status``; fails after ``within``."""
    t0 = time.monotonic()
    try:
        wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code == status, within,
                   f"/health to turn {status}", every=0.5)
    except TimeoutError as e:
        raise AssertionError(f"{e}:\n{rank_logs(tmp_path)}") from None
    return time.monotonic() - t0


def stop_ranks(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(timeout=30)


BODY = {"model": "model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}


def test_a_dead_rank_gives_503s_not_a_hang(setup, tmp_path):
    model, _ = setup
    (leader, follower), url = start_ranks(model, tmp_path)
    try:
        assert httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30).status_code == 200
        follower.kill()
        follower.wait(timeout=30)
        wait_for_health(url, 503, 30, tmp_path)
        r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert leader.poll() is None  # still answering: 503s, not a hang or a vanished port
    finally:
        stop_ranks((leader, follower))


def test_a_stuck_rank_gives_503s_until_it_answers_again(setup, tmp_path):
    """A rank that stops answering without closing its sockets (here:
    SIGSTOP) is never reported by the collective backend; rank 0 notices
    that its message has not got through for SHARE_TIMEOUT_SECONDS and turns
    unhealthy, and turns healthy again when the rank answers."""
    model, _ = setup
    (leader, follower), url = start_ranks(model, tmp_path)
    try:
        assert httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30).status_code == 200
        follower.send_signal(signal.SIGSTOP)
        waited = wait_for_health(url, 503, SHARE_TIMEOUT_SECONDS + 3 * HEARTBEAT_SECONDS + 10, tmp_path)
        assert waited >= SHARE_TIMEOUT_SECONDS - HEARTBEAT_SECONDS - 1  # not before the timeout
        r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and "has not answered" in r.json()["error"]["message"]
        follower.send_signal(signal.SIGCONT)
        wait_for_health(url, 200, 30, tmp_path)
        assert httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30).status_code == 200
    finally:
        stop_ranks((leader, follower))


def test_under_mlx_launch_a_dead_rank_ends_the_group(setup):
    """mlx.launch stops the other ranks when one dies: the group goes away
    promptly (for a supervisor to restart), it does not hang."""
    model, _ = setup
    proc, url = launch(["--model", str(model)], True)
    try:
        followers = [pid for pid in descendants(proc.pid) if b"MLX_RANK=1" in environ(pid)]
        assert followers
        for pid in followers:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)  # the whole group went away, promptly
    finally:
        kill(proc)
    with pytest.raises(httpx.ConnectError):  # and nothing is left holding the port
        httpx.get(url + "/health", timeout=5)


def descendants(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    out = []
    for pid in parents:
        p = pid
        while p > 1:
            p = parents.get(p, 0)
            if p == root:
                out.append(pid)
                break
    return out


def environ(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return b""


def test_every_field_of_a_plan_travels():
    """wire_plan / unwire_plan follow StepPlan's fields: a plan with every
    field set (a new prefill batch, cache orders, a proposal) comes back
    equal, field by field, with the follower's own sequences."""
    from dataclasses import fields

    from mola.engine.distributed import unwire_plan, wire_plan
    from mola.engine.plan import CacheOrders, StepPlan
    from mola.engine.prompt_cache import PrefixHit
    from mola.engine.sequence import SamplingParams, Sequence, SequenceStatus
    from mola.engine.speculative import Proposal

    def seq(i, prompt):
        return Sequence(prompt=prompt, params=SamplingParams(max_tokens=5, seed=i), slot=i, lora_scale=0.5,
                        seq_id=i)

    running, a, b = seq(7, [1, 2]), seq(8, [3, 4, 5]), seq(9, [6, 7, 8, 9])
    plan = StepPlan(keep=[0], prefill=[a, b], prefill_is_new=True, start=1, end=3, join=[1], decode=[running, b],
                    cache=CacheOrders(store_rows=[(1, 4, 6)], hits=[None, PrefixHit(3, 2)],
                                      store_joined=[(1, 5, 3)], evict=[2]),
                    proposal=Proposal([2, 0], [[5, 6], []]), preempted=[(1, seq(10, [1, 3]))], drop_prefill=True)
    defaults = StepPlan()
    assert all(getattr(plan, f.name) != getattr(defaults, f.name) for f in fields(StepPlan))
    seqs = {7: seq(7, [1, 2]), 10: seq(10, [1, 3])}
    again = unwire_plan(pickle.loads(pickle.dumps(wire_plan(plan))), seqs)
    for f in fields(StepPlan):
        mine, theirs = getattr(plan, f.name), getattr(again, f.name)
        if f.name in ("prefill", "decode"):
            assert [(s.seq_id, s.prompt, s.slot, s.params) for s in theirs] == \
                   [(s.seq_id, s.prompt, s.slot, s.params) for s in mine], f.name
        elif f.name == "preempted":
            assert [(row, s.seq_id) for row, s in theirs] == [(row, s.seq_id) for row, s in mine]
        else:
            assert theirs == mine, f.name
    assert again.decode[1] is again.prefill[1] is seqs[9] and again.decode[0] is seqs[7]
    assert all(s.status is SequenceStatus.PREFILLING for s in again.prefill)
