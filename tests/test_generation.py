"""Sampling and control on chat completions: n, logprobs, penalties, logit
bias, seeds (mola/frontend/pipeline.py, mola/engine/runner.py), against a
naive step-by-step decoder over plain mlx-lm."""

from __future__ import annotations

import math

import pytest

from helpers.references import detokenize, merged_model, reference_decode
from helpers.schemas import sse_events, validate_schema

QUESTION = "Tell me about the mountains."


@pytest.fixture(scope="module")
def prompt(server):
    tok = server.state.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def model_a(tiny_model, adapters):
    return merged_model(tiny_model, [adapters["a"]])[0]


def chat(client, **extra):
    body = {"model": "a", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    validate_schema("CreateChatCompletionResponse", r.json())
    return r.json()


def text_of(tok, tokens):
    return detokenize(tok, tokens, stop_at_eos=False)  # ignore_eos requests


def test_n_choices(client):
    greedy = chat(client, n=3)
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in greedy["choices"]}) == 1
    assert greedy["usage"]["completion_tokens"] == 24
    sampled = chat(client, n=3, temperature=1.0, seed=5, max_tokens=12)
    again = chat(client, n=3, temperature=1.0, seed=5, max_tokens=12)
    texts = [c["message"]["content"] for c in sampled["choices"]]
    assert texts == [c["message"]["content"] for c in again["choices"]] and len(set(texts)) == 3


def test_logprobs_are_the_models(client, server, prompt, model_a):
    body = chat(client, logprobs=True, top_logprobs=4)
    tok = server.state.tokenizer
    tokens, ref = reference_decode(model_a, prompt, 8, top_k=4)
    entries = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [tok.decode([t]) for t in tokens]
    for e, (lp, top) in zip(entries, ref):
        assert math.isclose(e["logprob"], lp, abs_tol=1e-4)
        assert [x["token"] for x in e["top_logprobs"]] == [tok.decode([t]) for t, _ in top]
        assert all(math.isclose(x["logprob"], v, abs_tol=1e-4) for x, (_, v) in zip(e["top_logprobs"], top))
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][-1]["logprob"]
        assert isinstance(e["bytes"], list)
    assert chat(client)["choices"][0]["logprobs"] is None
    only = chat(client, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in only)


def test_streamed_logprobs(client):
    body = {"model": "a", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    entries = []
    for c in events[:-1]:
        validate_schema("CreateChatCompletionStreamResponse", c)
        lp = c["choices"][0]["logprobs"]
        entries += lp["content"] if lp else []
    plain = chat(client, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert entries == plain


@pytest.mark.parametrize("freq, pres", [(1.5, 0.0), (0.0, 2.0), (0.7, -0.5)])
def test_penalties_match_a_naive_decoder(client, server, prompt, model_a, freq, pres):
    tok = server.state.tokenizer
    tokens, _ = reference_decode(model_a, prompt, 16, frequency_penalty=freq, presence_penalty=pres)
    plain, _ = reference_decode(model_a, prompt, 16)
    body = chat(client, max_tokens=16, frequency_penalty=freq, presence_penalty=pres)
    assert body["choices"][0]["message"]["content"] == text_of(tok, tokens)
    if freq > 0 or pres > 0:
        assert len(set(tokens)) >= len(set(plain))


def test_logit_bias(client, server, prompt, model_a):
    tok = server.state.tokenizer
    plain, _ = reference_decode(model_a, prompt, 6)
    ban = {plain[0]: -100.0, plain[1]: -100.0}
    boost = {7: 9.0}
    for bias in (ban, boost):
        want, _ = reference_decode(model_a, prompt, 6, bias=bias)
        body = chat(client, max_tokens=6, logit_bias={str(k): v for k, v in bias.items()})
        assert body["choices"][0]["message"]["content"] == text_of(tok, want)
    assert plain[0] not in reference_decode(model_a, prompt, 6, bias=ban)[0][:1]


def test_user_is_accepted_and_ignored(client):
    assert chat(client, user="someone")["choices"][0]["message"]["content"] == chat(client)["choices"][0]["message"]["content"]
