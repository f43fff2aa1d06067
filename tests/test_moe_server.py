"""A mixture-of-experts base through the HTTP API: expert adapters served
exactly beside dense ones, few expert slots shared by more expert adapters,
what /v1/adapters and /metrics say of their bytes, the refusals, and the
rest of mola (stacks, per-request scale, the prompt cache, structured
outputs, speculation) on an MoE base."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.references import detokenize, merged_model, reference_decode
from helpers.scripted import InProcessServer, tokenizer_model
from helpers.servers import start_server
from mola.config import AdapterSpec
from mola.engine.config import EngineConfig
from mola.engine.engine import Engine
from mola.errors import SlotsDoNotFit
from mola.models.loader import load_base_model
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.model import TinyModelSpec, make_tiny_model

QUESTION = "hello there, how are you?"
MAX_TOKENS = 8
EXPERT_KEYS = ("mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model = make_tiny_model(root / "qwen3-moe", TinyModelSpec(model_type="qwen3_moe"))
    other = make_tiny_model(root / "qwen3-moe-4", TinyModelSpec(model_type="qwen3_moe", num_experts=4))
    mixtral = make_tiny_model(root / "mixtral", TinyModelSpec(model_type="mixtral"))
    return {
        "model": model,
        "full": make_mlx_lm_lora(root / "full", model, rank=4, seed=1),
        "experts": make_mlx_lm_lora(root / "experts", model, rank=8, keys=EXPERT_KEYS, seed=2),
        "attn": make_mlx_lm_lora(root / "attn", model, rank=2, keys=("self_attn.q_proj",), seed=3),
        "four_experts": make_mlx_lm_lora(root / "four", other, rank=4, keys=EXPERT_KEYS, seed=4),
        "mixtral": make_mlx_lm_lora(root / "mixtral-ad", mixtral, rank=4, seed=5),
    }


@pytest.fixture(scope="module")
def server(moe):
    # Three slots, one of which carries expert LoRA: "full" and "experts" take turns in it.
    handle = start_server(model=str(moe["model"]), max_loras=3, max_expert_loras=1, max_lora_rank=8,
                          max_expert_lora_rank=12, allow_any_adapter_path=True, max_cpu_loras=4,
                          adapters=(AdapterSpec("full", str(moe["full"])), AdapterSpec("attn", str(moe["attn"])),
                                    AdapterSpec("experts", str(moe["experts"]))))
    yield handle
    handle.stop()


def ask(client, model, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def expected(server, moe, names=(), scales=None) -> str:
    model, _ = merged_model(moe["model"], [moe[n] for n in names], scales)
    tok = server.state.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    tokens, _ = reference_decode(model, prompt, MAX_TOKENS)
    return detokenize(tok, tokens, stop_at_eos=False)


def test_expert_adapters_take_turns_in_one_expert_slot_and_stay_exact(server, client, moe):
    want = {n: expected(server, moe, [n] if n else []) for n in (None, "full", "experts", "attn")}
    assert len(set(want.values())) == 4  # every adapter changes the answer
    for _ in range(2):  # each expert adapter evicts the other from the one expert slot
        for name in ("full", "experts", "attn", None):
            assert text(ask(client, name or "qwen3-moe")) == want[name], name
    listed = {a["id"]: a for a in client.get("/v1/adapters").json()["data"]}
    assert listed["attn"]["expert_nbytes"] == 0 and listed["attn"]["nbytes"] > 0
    assert 0 < listed["experts"]["expert_nbytes"] == listed["experts"]["nbytes"]
    assert 0 < listed["full"]["expert_nbytes"] < listed["full"]["nbytes"]
    # 2 layers x 3 projections x 8 experts x rank 8 x (in + out = 64 + 32) x 4 bytes (float32):
    # E times what the same LoRA on one dense projection of each would weigh.
    assert listed["experts"]["expert_nbytes"] == 2 * 3 * 8 * 8 * 96 * 4
    # what each adapts, as written in its files (the block index left out)
    assert listed["experts"]["targets"] == sorted(EXPERT_KEYS)
    assert listed["attn"]["targets"] == ["self_attn.q_proj"]
    metrics = client.get("/metrics").text
    assert f'mola_adapter_bytes{{adapter="experts",kind="experts"}} {float(listed["experts"]["nbytes"])}' in metrics
    assert "mola_expert_adapter_slots 1.0" in metrics


def test_stacks_and_request_scales_reach_the_experts(server, client, moe):
    assert text(ask(client, "full", lora_scale=0.5)) == expected(server, moe, ["full"], [0.5])
    stacked = ask(client, "full", adapters=[{"name": "experts", "scale": -0.7}])
    assert text(stacked) == expected(server, moe, ["full", "experts"], [1.0, -0.7])


def test_prompt_cache_and_structured_outputs_on_experts(client):
    first = ask(client, "experts")
    again = ask(client, "experts")
    assert text(again) == text(first)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    body = ask(client, "full", response_format={"type": "json_object"}, ignore_eos=False, max_tokens=40)
    content = text(body)
    if body["choices"][0]["finish_reason"] == "stop":
        json.loads(content)
    assert content.lstrip().startswith("{")


@pytest.mark.parametrize("adapter, words", [
    ("four_experts", ["4 experts", "8 experts"]),
    ("mixtral", ["block_sparse_moe"]),
])
def test_mismatched_expert_adapters_are_refused_by_name(client, moe, adapter, words):
    r = client.post("/v1/adapters", json={"name": adapter, "path": str(moe[adapter])})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_no_expert_slots_refuses_expert_adapters_and_still_serves_dense_ones(moe):
    """The refusal is the subject, in process over a scripted engine: the dense
    adapter is served from a slot holding its files (its math on this model
    is checked against merged weights through ``server`` above)."""
    handle = InProcessServer(tokenizer_model(moe["model"]), max_loras=2, max_expert_loras=0, max_lora_rank=8,
                             allow_any_adapter_path=True)
    try:
        with handle.client(timeout=60) as c:
            r = c.post("/v1/adapters", json={"name": "experts", "path": str(moe["experts"])})
            assert r.status_code == 400 and "--max-expert-loras" in r.json()["error"]["message"], r.text
            assert c.post("/v1/adapters", json={"name": "attn", "path": str(moe["attn"])}).status_code == 200
            assert ask(c, "attn")["model"] == "attn"
            (path, _), = handle.engine.slots[handle.engine.submitted[-1].slot].parts
            assert path == str(moe["attn"].resolve())
    finally:
        handle.stop()


def test_slots_that_cannot_fit_are_refused_at_start_with_the_numbers(moe):
    # One expert slot of rank 2^28 over 8 experts: TiBs of packs for one adapter at the ceilings, more than
    # any machine here has (the packs grow with the loads, but one such adapter could never load).
    config = EngineConfig(max_loras=64, max_lora_rank=8, expert_slots=64, max_expert_rank=1 << 28)
    engine = Engine(lambda: load_base_model(str(moe["model"])), config)
    with pytest.raises(SlotsDoNotFit) as e:
        engine.start()
    message = e.value.message
    assert "an expert slot" in message and "GiB" in message and "--max-expert-lora-rank" in message


def test_ngram_speculation_on_experts_keeps_the_answer(moe):
    handle = start_server(model=str(moe["model"]), max_loras=2, max_lora_rank=8, max_expert_lora_rank=8,
                          speculative="ngram", speculate_always=True, prompt_cache_bytes=0,
                          prompt_lookup_min=1,  # any token seen before drafts what followed it
                          adapters=(AdapterSpec("full", str(moe["full"])),))
    question = "one two three four one two three four one two three four one two three"
    try:
        model, _ = merged_model(moe["model"], [moe["full"]])
        tok = handle.state.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        tokens, _ = reference_decode(model, prompt, 24)
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            body = {"model": "full", "messages": [{"role": "user", "content": question}], "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == detokenize(tok, tokens, stop_at_eos=False)
            drafted = [line for line in c.get("/metrics").text.splitlines()
                       if line.startswith("mola_speculative_draft_tokens_total")]
            assert drafted and float(drafted[0].split()[-1]) > 0
    finally:
        handle.stop()
