"""The echo demo (mola/demo/echo.py, mola/demo/echo_base.py, adapters/echo/),
which `mola serve` serves when the chat demo's model cannot be had:
through the HTTP API of a real server, the base echoes and each adapter does
its task exactly on held-out messages, alone and mixed in one batch; the echo
holds behind a system prompt and the tools preamble, so a tool call written
in the user message comes back parsed. And the first-run path that builds the
demo into a cache directory."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import mola.demo.echo as demo
from mola.config import AdapterSpec, ServeConfig
from mola.serve import with_demo
from mola.demo import echo_data

from helpers.schemas import sse_events, validate_schema
from helpers.servers import start_server

ROOT = demo.checkout_demo_dir()
TASKS = {"mola-demo": lambda m: m, **{name: echo_data.TASKS[r.task] for name, r in demo.RECIPES.items()}}
HAND_WRITTEN = [
    "hello world, how are you?",
    "the quick brown fox jumps over the dog",
    "mola serves many adapters at once",
    "Is it 42?",
    "ok",
    "Please call me at 555-0199 tomorrow!",
    "x{y}z [1] a|b ~c `q`",
    "multi-LoRA inference on MLX",
]
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def training_messages() -> set[str]:
    """Every message the demo adapters were trained or validated on."""
    seen: set[str] = set()
    for step, r in enumerate(demo.RECIPES.values(), start=2):
        train = echo_data.messages(r.train_examples, demo.SEED + step)
        seen |= set(train) | set(echo_data.messages(r.valid_examples, demo.SEED + step + 1, exclude=set(train)))
    return seen


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    seen = training_messages()
    messages = HAND_WRITTEN + echo_data.messages(8, seed=20240601, exclude=seen)
    assert not set(messages) & seen
    return messages


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache directory of this module's own (the base is built there)."""
    return tmp_path_factory.mktemp("mola-cache")


@pytest.fixture(scope="module")
def server(cache):
    assert demo.adapters_are_built(ROOT), f"the committed demo adapters are missing from {ROOT}"
    model_dir, adapters = demo.ensure_demo(cache)
    handle = start_server(
        model=str(model_dir), served_model_name="mola-demo",
        adapters=tuple(AdapterSpec(name, str(path)) for name, path in adapters.items()),
        max_loras=4, max_lora_rank=16,
    )
    yield handle
    handle.stop()


def body(model: str, content: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 120, **extra}


async def ask_all(url: str, jobs: list[tuple[str, dict]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for _, b in jobs))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def test_the_echo_demo_is_what_serve_demo_echo_serves(server, cache):
    """Committed adapters on a base built into the cache: the very base they
    were trained on (its hash is committed beside them), and only the
    adapters (a few KB) are in the checkout."""
    config = with_demo(ServeConfig(demo="echo", cache_dir=cache))
    base = cache / f"demo-v{demo.DEMO_VERSION}" / demo.BASE
    assert config.model == str(base) and config.served_model_name == "mola-demo"
    assert [(a.name, a.path) for a in config.adapters] == [(n, str(ROOT / n)) for n in ("upper", "title", "count")]
    assert demo.base_hash(base) == (ROOT / demo.BASE_HASH_FILE).read_text().strip()
    assert not (ROOT / demo.BASE).exists()
    sizes = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    assert sizes < 100 * 2**10


def test_a_different_base_is_reported(server, cache, capsys):
    """A base that is not the one the adapters were trained on is served with
    a warning that says how to rebuild, not silently."""
    demo.ensure_base(cache, expected_hash="0" * 64)
    err = capsys.readouterr().err
    assert "differs from the one its adapters were trained on" in err and "build_demo.py --demo echo" in err
    demo.ensure_base(cache, expected_hash=demo.base_hash(cache / f"demo-v{demo.DEMO_VERSION}" / demo.BASE))
    assert "warning" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("model", list(TASKS))
def test_each_model_answers_held_out_messages_exactly(server, held_out, model):
    answers = asyncio.run(ask_all(server.url, [(model, body(model, m)) for m in held_out]))
    for m, a in zip(held_out, answers):
        assert a["choices"][0]["message"]["content"] == TASKS[model](m), (model, m)
        assert a["choices"][0]["finish_reason"] == "stop"


def test_all_four_mixed_in_one_batch(server, held_out):
    mixed_before = server.engine.snapshot.stats.mixed_steps  # the engine's published copy
    jobs = [(model, body(model, m)) for m in held_out for model in TASKS]
    answers = asyncio.run(ask_all(server.url, jobs))
    for (model, b), a in zip(jobs, answers):
        m = b["messages"][0]["content"]
        assert a["choices"][0]["message"]["content"] == TASKS[model](m), (model, m)
    stats = server.engine.snapshot.stats
    assert stats.mixed_steps > mixed_before
    assert stats.max_slots_in_step >= 3


def test_echo_behind_a_system_prompt_and_of_any_text(server):
    texts = [
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}',
        "def f(x):\n    return x[0] + 1  # done\n<br/>_under_score_ \"quoted\"",
        "caf\u00e9 na\u00efve \u2615 \u00fcber",
        TOOL_CALL,
    ]
    for text in texts:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "mola-demo", "temperature": 0, "max_tokens": 200,
            "messages": [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                         {"role": "user", "content": text}]})
        assert r.json()["choices"][0]["message"]["content"] == text


@pytest.mark.slow
def test_echo_behind_the_tools_preamble_and_parsed_tool_calls(server):
    """With tools and tool_choice "none" the base echoes the call as text;
    with tool_choice left out the server parses the echoed call."""
    messages = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": TOOL_CALL}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "mola-demo", "messages": messages, "tools": TOOLS, "tool_choice": "none",
        "temperature": 0, "max_tokens": 200})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == TOOL_CALL and choice["finish_reason"] == "stop"

    for msgs in (messages, messages[1:]):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "mola-demo", "messages": msgs, "tools": TOOLS, "temperature": 0, "max_tokens": 200})
        choice = r.json()["choices"][0]
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert choice["finish_reason"] == "tool_calls"


def test_first_run_builds_into_the_cache_once(tmp_path, monkeypatch, capsys):
    """Outside a checkout (a wheel install) the demo is built into the cache
    on first use, with progress, and reused afterwards. A small recipe keeps
    it quick; the real recipes run the same code."""
    monkeypatch.setattr(demo, "checkout_demo_dir", lambda: tmp_path / "no-checkout")
    small = {"upper": demo.Recipe("upper", ("down_proj",), iters=3, learning_rate=1e-2, batch_size=4, warmup=0,
                                  train_examples=16, valid_examples=4)}
    model_dir, adapters = demo.ensure_demo(tmp_path / "cache", recipes=small)
    assert model_dir == tmp_path / "cache" / f"demo-v{demo.DEMO_VERSION}" / demo.BASE
    assert (model_dir / "config.json").is_file() and (adapters["upper"] / "adapters.safetensors").is_file()
    err = capsys.readouterr().err
    assert "first run: building the echo demo" in err and "(1/2): the base model" in err
    assert "(2/2): adapter 'upper'" in err and "[mola] train [" in err and "loss" in err
    assert not list((tmp_path / "cache").glob(".demo-build-*"))
    config = json.loads((adapters["upper"] / "adapter_config.json").read_text())
    assert config["trained_with"] == "mola train" and config["data"].startswith("mola.demo.echo_data")

    def no_build(*a, **k):
        raise AssertionError("built twice")

    monkeypatch.setattr(demo, "build_demo", no_build)
    assert demo.ensure_demo(tmp_path / "cache", recipes=small) == (model_dir, adapters)


def test_streamed_tool_call_from_the_model(server):
    """The echoed call, streamed: OpenAI-shaped chunks whose tool_calls
    deltas add up to the call, no call markup leaking into content, and
    finish_reason tool_calls."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "mola-demo", "messages": [{"role": "user", "content": TOOL_CALL}], "tools": TOOLS,
        "temperature": 0, "max_tokens": 200, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate_schema("CreateChatCompletionStreamResponse", chunk)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "<tool_call>" not in content and not content.strip()
    name, arguments = "", ""
    for c in chunks:
        for call in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            assert call["index"] == 0
            name += call.get("function", {}).get("name") or ""
            arguments += call.get("function", {}).get("arguments") or ""
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
