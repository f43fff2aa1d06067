"""Adapters on a GGUF base (the real model, SmolLM2-135M-Instruct Q4_1), through mola's
engine and server: a GGUF LoRA in llama.cpp's layout gives llama.cpp's tokens (numpy
reference on gguf-py's tensors); its mlx-lm and PEFT twins give the same outputs; base
and adapter rows mixed in one batch give what they give alone; a mismatch is refused
naming both sides (a 400 over REST); and the served GGUF answers over HTTP."""

from __future__ import annotations

import httpx
import pytest

from helpers.engines import EngineRunner
from helpers.servers import start_server
from mola.config import AdapterSpec
from mola.errors import InvalidAdapter
from mola.testing.adapter import linear_shapes, random_lora, save_mlx_lm_adapter
from mola.adapters.formats.gguf_writer import save_gguf_adapter
from mola.testing.peft import save_peft_adapter

KEYS = tuple(linear_shapes({"hidden_size": 1, "intermediate_size": 1, "num_attention_heads": 1}))
LAYERS = 6  # the last six blocks, every linear of them
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_files(smollm_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm-adapters")
    weights = random_lora(smollm_gguf, rank=8, keys=KEYS, num_layers=LAYERS, scale=2.0, std=0.05, seed=7)
    return {
        "mlx": save_mlx_lm_adapter(root / "mlx", weights, num_layers=LAYERS, keys=KEYS),
        "gguf": save_gguf_adapter(root / "lora.gguf", weights, architecture="llama", n_head=9, n_kv_head=3),
        "peft": save_peft_adapter(root / "peft", weights),
    }


@pytest.fixture(scope="module")
def runner(smollm_gguf, lora_files):
    r = EngineRunner(smollm_gguf, adapters=list(lora_files.items()), max_tokens=MAX_TOKENS,
                     max_lora_rank=8)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def prompt(runner):
    return runner.loaded.tokenizer.encode("The capital of France is")


@pytest.fixture(scope="module")
def alone(runner, prompt):
    return {name: runner.run(prompt, name) for name in (None, "gguf", "mlx", "peft")}


@pytest.mark.slow
def test_a_gguf_lora_gives_llama_cpps_tokens(alone, prompt, llama_cpp, lora_files):
    tokens = alone["gguf"]
    assert tokens != alone[None]  # the adapter changes the answer
    ref = llama_cpp.with_lora(lora_files["gguf"]).logits(prompt + tokens)
    assert list(ref[len(prompt) - 1: len(prompt) - 1 + len(tokens)].argmax(-1)) == tokens


def test_mlx_lm_and_peft_twins_give_the_gguf_loras_outputs(alone):
    assert alone["mlx"] == alone["gguf"] == alone["peft"]


def test_base_and_adapter_rows_mixed_in_one_batch_give_what_they_give_alone(runner, prompt, alone):
    names = [None, "gguf", "mlx", None, "peft", "gguf"]
    outputs = runner.wait([runner.submit(prompt, name) for name in names])
    assert outputs == [alone[name] for name in names]


def test_mismatched_adapters_are_refused_naming_both_sides(runner, tiny_model, adapters, tmp_path):
    with pytest.raises(InvalidAdapter) as e:  # made for the tiny model: other shapes
        runner.add("tiny", runner.read(adapters["a"]))
    assert "expected lora_a (576, 4)" in e.value.message and "found lora_a (64, 4)" in e.value.message
    qwen = save_gguf_adapter(tmp_path / "qwen.gguf", random_lora(tiny_model, rank=2), architecture="qwen2")
    with pytest.raises(InvalidAdapter, match=r"LoRA for a 'qwen2' model.*base model's type is 'llama'"):
        runner.read(qwen)


@pytest.mark.slow
def test_the_served_gguf_over_http(smollm_gguf, lora_files, adapters):
    server = start_server(model=str(smollm_gguf), max_loras=2, max_lora_rank=8,
                          adapters=(AdapterSpec("pirate", str(lora_files["gguf"])),),
                          allow_any_adapter_path=True)
    try:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models][:2] == ["SmolLM2-135M-Instruct.Q4_1", "pirate"]
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        body = r.json()["choices"][0]
        assert body["message"]["content"] == "The capital of France is Paris."
        assert body["finish_reason"] == "stop"
        r = httpx.post(f"{server.url}/v1/adapters", json={"name": "tiny", "path": str(adapters["a"])})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "expected lora_a (576, 4)" in error["message"] and "found lora_a (64, 4)" in error["message"]
    finally:
        server.stop()
