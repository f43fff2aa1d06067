"""Several base models in one server (mola/bases/control.py): routing by model
id, loading on demand, --max-loaded-models, keep_alive (with an explicit
``now``), a base that fails to load, adapters checked against their own
base, and memory over load/unload cycles. Two tiny random bases of
different widths, each with an adapter (and the GGUF twin of one of them
as a third); answers are checked against each base served alone by a
server of one base."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import shutil
import threading

import httpx
import pytest
import uvicorn

from helpers.servers import bound_socket, start_server, wait_until
from mola.config import AdapterSpec, ServeConfig
from mola.server.app import create_app
from mola.bases.control import Bases, BaseStatus
from mola.server.startup import make_engine, start_base
from mola.server.metrics import Metrics, rss_bytes
from mola.testing.adapter import make_random_adapter
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

PROMPT = [{"role": "user", "content": "tell me about the sea"}]


@pytest.fixture(scope="module")
def two_bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    a = make_tiny_model(root / "a", TinyModelSpec(hidden_size=64, seed=1))
    b = make_tiny_model(root / "b", TinyModelSpec(hidden_size=96, intermediate_size=160, seed=2))
    adapters = {"a1": make_random_adapter(root / "a1", a, seed=3), "b1": make_random_adapter(root / "b1", b, seed=4)}
    adapters["g1"] = adapters["b1"]
    g = save_gguf_model(root / "b.gguf", b)  # B's GGUF twin: a base from a GGUF file
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    return {"a": str(a), "b": str(b), "g": str(g), "broken": str(broken), **{k: str(v) for k, v in adapters.items()}}


class Handle:
    def __init__(self, url, bases, loop, server, thread):
        self.url, self.bases, self.loop, self.server, self.thread = url, bases, loop, server, thread

    def run(self, coro):
        """Run ``coro`` on the server's event loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def serve_bases(paths, clock=None, engine_factory=None, **settings) -> Handle:
    """Bases A (default, adapter a1) and B (adapter b1), and any more in settings, on 127.0.0.1."""
    models = [{"name": "B", "model": paths["b"], "adapters": [{"name": "b1", "path": paths["b1"]}],
               "keep_alive": settings.pop("b_keep_alive", None)}, *settings.pop("models", [])]
    sock = bound_socket()
    config = ServeConfig.from_settings(
        host="127.0.0.1", port=sock.getsockname()[1], log_level="warning", model=paths["a"], served_model_name="A",
        adapters=[AdapterSpec("a1", paths["a1"])], models=models, max_lora_rank=8, max_loras=2, **settings)
    box, started = {}, threading.Event()
    given = {"clock": clock} if clock is not None else {}
    start = functools.partial(start_base, engine_factory=engine_factory) if engine_factory else start_base

    async def main():
        bases = Bases.declared(config, Metrics(), start, **given)
        await bases.preload()
        server = uvicorn.Server(uvicorn.Config(create_app(bases.default.state, bases), host="127.0.0.1",
                                               port=config.http.port, log_level="warning"))
        box.update(bases=bases, loop=asyncio.get_running_loop(), server=server)
        started.set()
        await server.serve(sockets=[sock])

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(60), "the server did not start"
    # uvicorn binds after serve() starts, and signals nothing when it has
    wait_until(lambda: box["server"].started, timeout=60, what="uvicorn to bind")
    return Handle(f"http://127.0.0.1:{config.http.port}", box["bases"], box["loop"], box["server"], thread)


def chat(url, model, max_tokens=8, **extra):
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra})


def text(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def alone(paths, base, adapter, name) -> dict[str, str]:
    """Greedy answers of a server of one base: the reference."""
    with_adapter = [AdapterSpec(adapter, paths[adapter])]
    handle = start_server(model=paths[base], served_model_name=name, adapters=with_adapter, max_lora_rank=8,
                          max_loras=2)
    try:
        return {name: text(chat(handle.url, name)), adapter: text(chat(handle.url, adapter))}
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def reference(two_bases):
    return {**alone(two_bases, "a", "a1", "A"), **alone(two_bases, "b", "b1", "B"), **alone(two_bases, "g", "g1", "G")}


def test_mixed_traffic_equals_each_base_alone(two_bases, reference):
    h = serve_bases(two_bases, models=[{"name": "G", "model": two_bases["g"],
                                        "adapters": [{"name": "g1", "path": two_bases["g1"]}]}])
    try:
        assert h.bases.by_name["B"].status is BaseStatus.DECLARED  # not loaded until asked for
        ids = ["A", "b1", "a1", "B", "G", "g1"] * 2
        with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
            answers = list(pool.map(lambda m: text(chat(h.url, m)), ids))
        assert answers == [reference[m] for m in ids]
        assert h.bases.by_name["B"].status is BaseStatus.LOADED  # the request loaded it
        cards = {c["id"]: c for c in httpx.get(h.url + "/v1/models").json()["data"]}
        assert cards["B"]["status"] == "loaded" and cards["b1"]["parent"] == "B" and cards["a1"]["parent"] == "A"
        metrics = httpx.get(h.url + "/metrics").text
        assert 'mola_base_running_requests{base="B"}' in metrics
        assert 'mola_base_status{base="B",status="loaded"} 1.0' in metrics
        # A stack of adapters of two bases: a 400 naming both.
        r = chat(h.url, "a1", adapters=[{"name": "b1"}])
        assert r.status_code == 400 and "b1" in r.json()["error"]["message"]
    finally:
        h.stop()


def test_models_shows_a_base_while_it_loads(two_bases, reference):
    """The request that loads B waits, streaming nothing, while /v1/models says B is loading."""
    gate = threading.Event()

    def factory(config, group=None):
        engine = make_engine(config, group)
        if config.served_model_name == "B":
            start = engine.start
            engine.start = lambda: gate.wait(60) and start()
        return engine

    h = serve_bases(two_bases, engine_factory=factory)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(chat, h.url, "b1")
            status = lambda: {c["id"]: c for c in httpx.get(h.url + "/v1/models").json()["data"]}["B"]["status"]
            wait_until(lambda: status() == "loading", timeout=30, what="B to be loading")
            assert text(chat(h.url, "a1")) == reference["a1"]  # A serves meanwhile
            assert not answer.done()
            gate.set()
            assert text(answer.result(60)) == reference["b1"]
        assert status() == "loaded"
    finally:
        gate.set()
        h.stop()


def test_models_lists_unloaded_bases(two_bases):
    h = serve_bases(two_bases)
    try:
        cards = {c["id"]: c for c in httpx.get(h.url + "/v1/models").json()["data"]}
        assert cards["A"]["status"] == "loaded" and cards["B"]["status"] == "declared"
        assert cards["b1"]["parent"] == "B" and cards["b1"]["root"] == two_bases["b1"]
    finally:
        h.stop()


def test_one_loaded_model_swaps_bases(two_bases, reference):
    h = serve_bases(two_bases, max_loaded_models=1)
    try:
        for model in ["B", "a1", "b1", "A"]:
            assert text(chat(h.url, model)) == reference[model]
            loaded = [b.name for b in h.bases if b.status is BaseStatus.LOADED]
            assert loaded == ["B" if model in ("B", "b1") else "A"]
            if model == "B":  # the default base unloaded: the process's rows stay, its engine's go
                metrics = httpx.get(h.url + "/metrics").text
                assert "\nmola_memory_active_bytes " in metrics and "\nmola_running_requests " not in metrics
        assert (h.bases.by_name["A"].num_unloads, h.bases.by_name["B"].num_unloads) == (2, 2)
        # A request in flight on A: B cannot be loaded, 503 with Retry-After, A untouched.
        lease = h.run(h.bases.enter("A"))
        r = chat(h.url, "B")
        assert r.status_code == 503 and "Retry-After" in r.headers and "busy" in r.json()["error"]["message"]
        assert text(chat(h.url, "a1")) == reference["a1"]
        lease.release()
        # Alternating traffic at once: every answer is whole and right, or a 503 to retry.
        ids = ["A", "B", "a1", "b1"] * 3
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda m: chat(h.url, m), ids))
        for model, r in zip(ids, responses):
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                assert text(r) == reference[model]
    finally:
        h.stop()


def test_keep_alive_unloads_when_idle_and_reloads(two_bases, reference):
    h = serve_bases(two_bases, b_keep_alive=100.0)
    try:
        b = h.bases.by_name["B"]
        assert text(chat(h.url, "b1")) == reference["b1"]
        assert h.run(h.bases.unload_idle(b.last_used + 99)) == []
        assert h.run(h.bases.unload_idle(b.last_used + 100)) == ["B"]  # A has no keep_alive
        assert b.status is BaseStatus.DECLARED and b.state is None
        assert text(chat(h.url, "B")) == reference["B"]
        assert (b.num_loads, b.status) == (2, BaseStatus.LOADED)
    finally:
        h.stop()


def test_stored_responses_outlive_their_base_and_continue_on_another(two_bases):
    """A response stored on B is kept by the server, not by B: it is read and
    continued after B idles out or is unloaded, naming A or B."""
    h = serve_bases(two_bases, b_keep_alive=100.0)

    def respond(model, **extra):
        r = httpx.post(h.url + "/v1/responses", timeout=60, json={
            "model": model, "input": "remember me", "max_output_tokens": 4, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    try:
        b = h.bases.by_name["B"]
        first = respond("B", store=True)
        # The base lease ends just after the response's last byte: wait for it, not a clock.
        wait_until(lambda: b.in_flight == 0, 10, "the request's base lease to end")
        assert h.run(h.bases.unload_idle(b.last_used + 100)) == ["B"]
        got = httpx.get(h.url + f"/v1/responses/{first['id']}", timeout=60)
        assert got.status_code == 200 and got.json() == first, got.text
        assert b.status is BaseStatus.DECLARED  # reading it loaded nothing
        on_a = respond("A", previous_response_id=first["id"])
        assert on_a["model"] == "A" and on_a["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        again = respond("B", previous_response_id=first["id"], store=True)  # loads B again
        assert h.run(h.bases.unload("B"))
        for rid in (first["id"], again["id"]):
            assert httpx.get(h.url + f"/v1/responses/{rid}", timeout=60).status_code == 200
    finally:
        h.stop()


def test_adapter_for_another_base_is_a_400(two_bases):
    h = serve_bases(two_bases, allow_any_adapter_path=True)
    try:
        r = httpx.post(h.url + "/v1/adapters", timeout=60,
                       json={"name": "wrong", "path": two_bases["b1"], "base": "A"})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "shape" in message.lower() and "96" in message, message  # B's width, not A's 64
        r = httpx.post(h.url + "/v1/adapters", timeout=60, json={"name": "b2", "path": two_bases["b1"], "base": "B"})
        assert r.status_code == 200, r.text
        cards = {c["id"]: c for c in httpx.get(h.url + "/v1/models").json()["data"]}
        assert cards["b2"]["parent"] == "B"
        r = httpx.post(h.url + "/v1/adapters", json={"name": "x", "path": two_bases["b1"], "base": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "base"
    finally:
        h.stop()


class Clock:
    """The bases' clock, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_base_that_fails_to_load(two_bases, reference, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(two_bases["broken"], broken)
    clock = Clock()
    h = serve_bases(two_bases, clock=clock, models=[{"name": "broken", "model": str(broken)}])
    try:
        r = chat(h.url, "broken")
        assert r.status_code == 503, r.text
        assert "'broken' failed to load" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "30"
        assert text(chat(h.url, "A")) == reference["A"]
        assert text(chat(h.url, "b1")) == reference["b1"]
        cards = {c["id"]: c for c in httpx.get(h.url + "/v1/models").json()["data"]}
        assert cards["broken"]["status"] == "failed" and "config.json" in cards["broken"]["error"]
        assert httpx.get(h.url + "/health").status_code == 200
        # Mended on disk: not tried again before retry_failed_after (30 s) has passed, then loaded.
        shutil.rmtree(broken)
        shutil.copytree(two_bases["a"], broken)
        clock.now += 20
        r = chat(h.url, "broken")
        assert r.status_code == 503 and r.headers["Retry-After"] == "10", r.text
        clock.now += 10
        assert text(chat(h.url, "broken")) == reference["A"]  # the same weights as A
        assert h.bases.by_name["broken"].status is BaseStatus.LOADED
    finally:
        h.stop()


def test_adapters_loaded_over_rest_outlive_an_unload(two_bases, reference):
    """A base's adapters after an unload and a reload: one loaded over REST
    is served again (read on its first request), one unloaded over REST
    stays unloaded."""
    h = serve_bases(two_bases, allow_any_adapter_path=True)
    try:
        r = httpx.post(h.url + "/v1/adapters", timeout=60, json={"name": "b2", "path": two_bases["b1"], "base": "B"})
        assert r.status_code == 200, r.text
        assert httpx.delete(h.url + "/v1/adapters/b1", timeout=60).status_code == 200
        assert h.run(h.bases.unload("B"))
        ids = {c["id"]: c for c in httpx.get(h.url + "/v1/models").json()["data"]}
        assert ids["b2"]["parent"] == "B" and "b1" not in ids and ids["B"]["status"] == "declared"
        assert text(chat(h.url, "b2")) == reference["b1"]  # loads B, then reads b2
        assert chat(h.url, "b1").status_code == 404
        records = {r["id"]: r for r in httpx.get(h.url + "/v1/adapters?base=B").json()["data"]}
        assert set(records) == {"b2"} and records["b2"]["source"] == "rest"
    finally:
        h.stop()


def test_memory_budget_holds_at_a_first_load(two_bases):
    """--models-memory-bytes before a base's size is known: its weight files
    stand for it, and once loaded its measured size is what counts."""
    from mola.bases.host_memory import file_bytes

    h = serve_bases(two_bases)
    a_bytes = h.bases.by_name["A"].nbytes
    h.stop()
    b_files = file_bytes(two_bases["b"])
    # B's files alone do not fit beside A: A unloads before B loads.
    h = serve_bases(two_bases, models_memory_bytes=a_bytes + b_files - 1)
    try:
        assert chat(h.url, "B").status_code == 200
        assert [b.name for b in h.bases if b.status is BaseStatus.LOADED] == ["B"]
    finally:
        h.stop()
    # B's files fit beside A: B loads; what counts then is each base's weights as measured and its slot
    # packs as they are (sized to the adapters loaded), and the loaded bases hold within the budget.
    h = serve_bases(two_bases, models_memory_bytes=a_bytes + b_files)
    try:
        assert chat(h.url, "B").status_code == 200
        b = h.bases.by_name["B"]
        assert b.nbytes <= b_files and b.held_bytes == b.nbytes + b.state.engine.engine.pack_stats.nbytes
        loaded = [x for x in h.bases if x.status is BaseStatus.LOADED]
        assert b in loaded and sum(x.held_bytes for x in loaded) <= a_bytes + b_files
    finally:
        h.stop()


def test_memory_returns_after_load_unload_cycles(two_bases):
    import mlx.core as mx

    h = serve_bases(two_bases)
    try:
        def cycle():
            assert chat(h.url, "b1").status_code == 200
            assert h.run(h.bases.unload("B"))
            return mx.get_active_memory(), rss_bytes()

        first = cycle()
        for _ in range(9):
            last = cycle()
        assert h.bases.by_name["B"].num_loads == 10
        assert last[0] <= first[0] * 1.05, (first, last)
        assert last[1] <= first[1] * 1.05, (first, last)
    finally:
        h.stop()


def test_flags_and_config_file_declare_bases(tmp_path):
    from mola.cli import build_parser, config_from_args

    (tmp_path / "b").mkdir()
    (tmp_path / "mola.toml").write_text(
        'model = "a"\nkeep_alive = 60\n[[models]]\nname = "B"\nmodel = "./b"\nmax_loras = 2\npin = true\n'
        'adapters = [{ name = "b1", path = "./b1" }]\n')
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "mola.toml"), "--model", "C=org/c",
                                      "--max-loaded-models", "2"])
    config = config_from_args(args)
    assert config.model == "a" and [m.name for m in config.bases.models] == ["B", "C"]
    b = config.for_base(config.bases.models[0])
    assert b.model == str(tmp_path / "b") and b.served_model_name == "B" and b.engine.max_loras == 2
    assert [a.name for a in b.adapters] == ["b1"] and b.bases.keep_alive == 60 and config.bases.models[0].pin
    assert config.bases.max_loaded_models == 2 and config.for_base(config.bases.models[1]).model == "org/c"
    with pytest.raises(ValueError, match="more than once"):
        ServeConfig.from_settings(model="a", adapters=(AdapterSpec("B", "x"),), models=[{"name": "B", "model": "b"}])


def test_mola_chat_switches_bases(two_bases, reference, tmp_path):
    """`mola chat`'s /model names a base or an adapter of any base: it says
    when the switch lands on another base, and whether that is loaded yet."""
    import os
    import sys

    import pexpect

    h = serve_bases(two_bases)
    try:
        child = pexpect.spawn(sys.executable, ["-m", "mola", "chat", "--url", h.url, "A", "--max-tokens", "8",
                                               "--temperature", "0", "--history", str(tmp_path / "history")],
                              encoding="utf-8", timeout=60, dimensions=(50, 400),
                              env={**os.environ, "TERM": "dumb", "INPUTRC": os.devnull, "MOLA_CACHE": str(tmp_path)})
        child.expect_exact("A> ")
        child.sendline("/model b1")
        child.expect_exact("now talking to b1 (an adapter on another base model, B, not loaded yet: its first "
                           "answer loads it); the conversation goes on")
        child.expect_exact("b1> ")
        child.sendline(PROMPT[0]["content"])
        child.expect_exact(reference["b1"].replace("\n", "\r\n") + "\r\nb1> ")
        child.sendline("/adapters")
        child.expect_exact("  B  (base model, loaded)")
        child.expect_exact("b1> ")
        child.sendline("/model B")
        child.expect_exact("now talking to B; the conversation goes on")  # b1's own base
        child.expect_exact("B> ")
        child.sendline("/model A")
        child.expect_exact("now talking to A (another base model); the conversation goes on")
        child.expect_exact("A> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
    finally:
        h.stop()


def test_a_failed_base_is_loaded_again_by_post_and_an_idle_one_unloaded(two_bases, reference, tmp_path):
    """POST /v1/models/{id}/load tries a failed base again at once (no
    backoff to wait out); /unload unloads an idle base; both answer its card."""
    broken = tmp_path / "broken"
    shutil.copytree(two_bases["broken"], broken)
    h = serve_bases(two_bases, clock=Clock(), models=[{"name": "broken", "model": str(broken)}])
    try:
        r = httpx.post(h.url + "/v1/models/broken/load", timeout=60)
        assert r.status_code == 503 and "'broken' failed to load" in r.json()["error"]["message"], r.text
        shutil.rmtree(broken)
        shutil.copytree(two_bases["a"], broken)
        r = httpx.post(h.url + "/v1/models/broken/load", timeout=60)  # the clock has not moved
        assert r.status_code == 200 and r.json()["status"] == "loaded" and "error" not in r.json(), r.text
        assert text(chat(h.url, "broken")) == reference["A"]
        r = httpx.post(h.url + "/v1/models/broken/unload", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "declared", r.text
        assert httpx.post(h.url + "/v1/models/nothing/load", timeout=60).status_code == 404
    finally:
        h.stop()


def test_a_gguf_base_is_sized_by_its_plan_before_its_first_load(two_bases, tmp_path):
    """A Q8_0 file served dequantized (float32 on a CPU) takes about four
    times its file: --models-memory-bytes is checked against the plan
    (models/fit.py) before the first load, and the plan is what it takes."""
    from mola.bases.host_memory import file_bytes, planned_bytes

    q8 = save_gguf_model(tmp_path / "b.Q8_0.gguf", two_bases["b"], codec="Q8_0")
    planned = planned_bytes(str(q8), "auto")
    assert planned > 3 * file_bytes(str(q8))
    h = serve_bases(two_bases, models=[{"name": "q8", "model": str(q8)}])
    try:
        assert chat(h.url, "q8").status_code == 200
        base = h.bases.by_name["q8"]
        assert base.state.engine.engine.pack_stats.nbytes == 0  # no adapter: the slot packs hold nothing
        assert base.nbytes == planned  # the weights as planned
        a_bytes = h.bases.by_name["A"].nbytes
    finally:
        h.stop()
    # The plan does not fit beside A (the file would): A unloads before q8 loads.
    h = serve_bases(two_bases, models=[{"name": "q8", "model": str(q8)}], models_memory_bytes=a_bytes + planned - 1)
    try:
        assert h.bases.by_name["q8"].size_guess() == planned
        assert chat(h.url, "q8").status_code == 200
        assert h.bases.by_name["A"].num_unloads == 1
    finally:
        h.stop()


def test_pushed_factors_go_with_their_base(two_bases):
    """An adapter pushed from memory onto a base is held until that base
    unloads; it is not on disk, so it does not come back (a 404 after)."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    from mola.client import push_adapter

    trained = load_adapters(load(two_bases["b"])[0], two_bases["b1"])
    h = serve_bases(two_bases)
    try:
        assert push_adapter(h.url, "p1", trained, base="B")["version"] == 1
        assert text(chat(h.url, "p1")) == text(chat(h.url, "b1"))
        state = h.bases.by_name["B"].state
        source, held = state.registry.get("p1").path, state.loader.pushed
        assert source in held
        assert h.run(h.bases.unload("B"))
        assert source not in held and len(held) == 0
        assert chat(h.url, "p1").status_code == 404
    finally:
        h.stop()
