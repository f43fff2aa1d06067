"""Activated LoRA in the engine's batch (issue 37, first part: the LoRA
layer's per-position delta; Sequence.adapter_start): a row's adapter applies
from its invocation's position on, the base alone before it. Checked against
a naive per-position loop over plain mlx-lm: one KV cache fed token by token,
by the base model before the start and by the adapter merged into the base
from it; alone and in one batch with plain LoRA rows and base rows, over
prefill chunks that cut across the starts."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers.engines import EngineRunner, together
from helpers.references import merged_model

MAX_TOKENS = 12


def activated_reference(base, merged, prompt: list[int], start: int) -> list[int]:
    """Greedy: position p of the prompt fed alone, to ``merged`` if p >= start
    else to ``base``, into one cache; then the answer, all merged."""
    cache = make_prompt_cache(base)
    for p, token in enumerate(prompt[:-1]):
        (merged if p >= start else base)(mx.array([[token]]), cache=cache)
    token, out = prompt[-1], []
    for _ in range(MAX_TOKENS):
        logits = (merged if len(prompt) - 1 + len(out) >= start else base)(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out


@pytest.fixture(scope="module")
def models(tiny_model, adapters):
    return merged_model(tiny_model)[0], merged_model(tiny_model, [adapters["a"]])[0]


@pytest.mark.parametrize("prefill_step_size", [16, 512])  # each prompt prefilled alone in chunks; all at once
def test_activated_rows_match_a_per_position_loop_in_a_mixed_batch(tiny_model, adapters, models, prefill_step_size):
    base, merged = models
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 23, 57, 31)]
    starts = [(0, 0), (0, 9), (1, 22), (2, 30), (3, 30)]  # (prompt, start): from the first token to the last
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS,
                     prefill_step_size=prefill_step_size)
    try:
        alone = r.run(prompts[0], "a", adapter_start=9)
        seqs = together(r, lambda: [
            *(r.submit(prompts[i], "a", adapter_start=s) for i, s in starts),
            r.submit(prompts[0], "b"), r.submit(prompts[1]), r.submit(prompts[2], "a")])
        outputs = r.wait(seqs)
    finally:
        r.stop()
    references = [activated_reference(base, merged, prompts[i], s) for i, s in starts]
    assert alone == references[1]
    # the same prompt and start comes back from the cache of its own identity, all but its last token;
    # the same prompt with another start shares nothing with it (only a start-0 row's empty base part)
    assert seqs[1].num_cached_tokens == len(prompts[0]) - 1
    assert seqs[0].num_cached_tokens == 0
    assert outputs[: len(starts)] == references
    # the plain rows beside them are what plain LoRA and the base give
    b = merged_model(tiny_model, [adapters["b"]])[0]
    assert outputs[len(starts)] == activated_reference(b, b, prompts[0], 0)
    assert outputs[len(starts) + 1] == activated_reference(base, base, prompts[1], 0)
    assert outputs[len(starts) + 2] == activated_reference(base, merged, prompts[2], 0)
    # and the start matters: later than 0 it is neither plain LoRA nor the base
    assert references[1] not in (references[0], activated_reference(base, base, prompts[0], 0))


def test_activated_rows_on_expert_slots_of_a_mixture_of_experts(tmp_path):
    """On a mixture of experts whose every slot can carry expert LoRA, an
    activated (attention-only) LoRA takes an expert slot and shares its prefill
    with an expert LoRA's row: each answers as its reference does."""
    from mola.testing.adapter import make_mlx_lm_lora
    from mola.testing.model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(tmp_path / "moe", TinyModelSpec(model_type="qwen3_moe"))
    attn = make_mlx_lm_lora(tmp_path / "attn", model, rank=4, keys=("self_attn.q_proj", "self_attn.v_proj"), seed=3)
    experts = make_mlx_lm_lora(tmp_path / "experts", model, rank=4, seed=1)  # every linear, experts too
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (30, 22)]
    r = EngineRunner(model, max_tokens=MAX_TOKENS, max_loras=2, max_lora_rank=8, expert_slots=2, max_expert_rank=8)
    try:
        r.add("attn", r.read(attn))  # slot 1 and 2: both expert slots
        r.add("experts", r.read(experts))
        outputs = r.wait(together(r, lambda: [r.submit(prompts[0], "attn", adapter_start=12),
                                              r.submit(prompts[1], "experts")]))
    finally:
        r.stop()
    base = merged_model(model)[0]
    assert outputs[0] == activated_reference(base, merged_model(model, [attn])[0], prompts[0], 12)
    with_experts = merged_model(model, [experts])[0]
    assert outputs[1] == activated_reference(with_experts, with_experts, prompts[1], 0)


# ---- formats: PEFT's alora_invocation_tokens, llama.cpp's adapter.alora.invocation_tokens ----------

INVOCATION = [7, 11, 13]


@pytest.fixture(scope="module")
def peft_alora(tiny_model, adapters, tmp_path_factory):
    """Adapter a as a PEFT activated LoRA invoked by INVOCATION."""
    import json

    from mola.adapters.formats import read_adapter
    from mola.testing.peft import save_peft_adapter

    path = save_peft_adapter(tmp_path_factory.mktemp("alora") / "a", read_adapter(adapters["a"]))
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": INVOCATION}))
    return path


def test_both_formats_carry_the_invocation_and_refuse_a_malformed_one(peft_alora, tmp_path):
    import json
    import shutil

    from test_format_gguf import write_raw_gguf

    from mola.adapters.formats import read_adapter
    from mola.adapters.weights import invocation_start
    from mola.errors import InvalidAdapter

    assert read_adapter(peft_alora).invocation_tokens == tuple(INVOCATION)
    gguf = write_raw_gguf(tmp_path / "alora.gguf", extra={"adapter.alora.invocation_tokens": [5, 9]})
    assert read_adapter(gguf).invocation_tokens == (5, 9)
    bad = shutil.copytree(peft_alora, tmp_path / "bad")
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": []}))
    with pytest.raises(InvalidAdapter, match="alora_invocation_tokens .* non-empty list"):
        read_adapter(bad)
    # PEFT's rule: the last place the invocation starts
    assert invocation_start((7, 11), [7, 11, 3, 7, 11, 4]) == 3
    assert invocation_start((7, 11), [7, 3, 11]) is None


def test_an_activated_lora_over_the_api(tiny_model, peft_alora, models):
    """/v1/completions on token prompts: with the invocation, the answer of the
    per-position loop from where it starts, ``alora_invoked`` true, the tokens
    before it from the base's prompt cache; without it, the base's answer,
    ``alora_invoked`` false; the base model's choices have no such field."""
    import httpx

    from helpers.references import detokenize
    from helpers.servers import start_server
    from mola.config import AdapterSpec

    base, merged = models
    rng = random.Random(9)
    head, tail = [rng.randrange(20, 500) for _ in range(20)], [rng.randrange(20, 500) for _ in range(6)]
    invoked, plain = head + INVOCATION + tail, head + tail
    handle = start_server(model=str(tiny_model), adapters=[AdapterSpec("al", str(peft_alora))], max_lora_rank=16)
    try:
        def complete(prompt, model="al", stream=False):
            r = httpx.post(handle.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": stream})
            assert r.status_code == 200, r.text
            return r

        tokenizer = handle.state.tokenizer
        complete(head, "tiny")  # the base model's turn: its KV goes to the prompt cache
        answer = complete(invoked).json()
        # the activated turn prefills from the base's cache: everything before its invocation
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(head)
        yes = answer["choices"][0]
        assert yes["alora_invoked"] is True
        assert yes["text"] == detokenize(tokenizer, activated_reference(base, merged, invoked, len(head)), False)
        # asked again, the part after the invocation comes from the activated LoRA's own entry
        again = complete(invoked).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(invoked) - 1
        assert again["choices"][0]["text"] == yes["text"]
        no = complete(plain).json()["choices"][0]
        assert no["alora_invoked"] is False
        assert no["text"] == detokenize(tokenizer, activated_reference(base, base, plain, 0), False)
        assert "alora_invoked" not in complete(plain, "tiny").json()["choices"][0]
        last = [line for line in complete(invoked, stream=True).text.splitlines() if '"finish_reason": "length"' in
                line.replace('"finish_reason":"length"', '"finish_reason": "length"')]
        assert last and '"alora_invoked": true' in last[0].replace('"alora_invoked":true', '"alora_invoked": true')
    finally:
        handle.stop()


def test_the_responses_and_messages_apis_say_whether_it_was_invoked(tiny_model, adapters, tmp_path):
    """An activated LoRA invoked by the assistant's role header, as one is
    trained: the templated conversation holds it, so /v1/responses and
    /v1/messages answer with ``alora_invoked`` true (streamed too, on the
    response and the message objects); invoked by tokens it does not hold,
    false; the base model's objects have no such field. (Protocol only: in
    process, over the scripted engine; the activated rows' numbers are the
    tests above.)"""
    import json

    from mlx_lm.utils import load_tokenizer

    from helpers.scripted import InProcessServer, tokenizer_model
    from mola.adapters.formats import read_adapter
    from mola.adapters.weights import invocation_start
    from mola.config import AdapterSpec
    from mola.testing.peft import save_peft_adapter

    messages = [{"role": "user", "content": "Say hi"}]
    templated = load_tokenizer(tiny_model).apply_chat_template(messages, add_generation_prompt=True)
    header = templated[-3:]
    paths = {}
    for name, tokens in (("header", header), ("absent", INVOCATION)):
        assert (invocation_start(tuple(tokens), templated) is not None) == (name == "header")
        path = save_peft_adapter(tmp_path / name, read_adapter(adapters["a"]))
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": list(tokens)}))
        paths[name] = path
    handle = InProcessServer(tokenizer_model(tiny_model), adapters=[AdapterSpec(n, str(p)) for n, p in paths.items()],
                             max_lora_rank=16)
    try:
        with handle.client(timeout=60) as c:
            def post(route, model, stream=False):
                body = {"model": model, "stream": stream, **(
                    {"input": messages[0]["content"], "max_output_tokens": 4} if route == "responses" else
                    {"messages": messages, "max_tokens": 4})}
                r = c.post(f"/v1/{route}", json=body)
                assert r.status_code == 200, r.text
                if not stream:
                    return r.json()
                events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
                return next(e["response"] if route == "responses" else e["message"] for e in events
                            if e["type"] in ("response.created", "message_start"))

            for route in ("responses", "messages"):
                for stream in (False, True):
                    assert post(route, "header", stream)["alora_invoked"] is True, (route, stream)
                    assert post(route, "absent", stream)["alora_invoked"] is False, (route, stream)
                assert "alora_invoked" not in post(route, "tiny")
        header_rows = [seq for seq in handle.engine.submitted if seq.adapter_start is not None]
        assert len(header_rows) == 4 and all(seq.adapter_start == len(seq.prompt) - 3 for seq in header_rows)
    finally:
        handle.stop()
