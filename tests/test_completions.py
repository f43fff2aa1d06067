"""POST /v1/completions against plain mlx-lm (mola/server/routes/completions.py)."""

from __future__ import annotations

import math

import openai
import pytest

from helpers.references import detokenize, merged_model, reference_decode
from helpers.schemas import sse_events, validate_schema

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def models(tiny_model, adapters):
    return {"tiny": merged_model(tiny_model)[0], "b": merged_model(tiny_model, [adapters["b"]])[0]}


def detok(tok, tokens):
    return detokenize(tok, tokens, stop_at_eos=False)  # ignore_eos requests


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    validate_schema("CreateCompletionResponse", r.json())
    return r.json()


def test_string_prompt_matches_reference(client, server, models):
    tok = server.state.tokenizer
    for model_id in ("tiny", "b"):
        body = complete(client, model=model_id, prompt=PROMPT, max_tokens=12, ignore_eos=True)
        tokens, _ = reference_decode(models[model_id], tok.encode(PROMPT), 12)
        assert body["choices"][0]["text"] == detok(tok, tokens)
        assert body["object"] == "text_completion" and body["model"] == model_id
        usage = dict(body["usage"])
        details = usage.pop("prompt_tokens_details")  # cached_tokens: tests/test_prompt_cache_server.py
        assert usage == {"prompt_tokens": len(tok.encode(PROMPT)), "completion_tokens": 12,
                         "total_tokens": len(tok.encode(PROMPT)) + 12}
        assert set(details) == {"cached_tokens"} and 0 <= details["cached_tokens"] < usage["prompt_tokens"]


def test_default_max_tokens_is_16(client):
    body = complete(client, prompt=PROMPT, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_prompt_forms_and_choice_order(client, server, models):
    tok = server.state.tokenizer
    prompts = ["Hello there", "Numbers: 1 2 3"]
    ids = [tok.encode(p) for p in prompts]
    by_text = complete(client, prompt=prompts, max_tokens=6, ignore_eos=True, n=2)
    by_ids = complete(client, prompt=ids, max_tokens=6, ignore_eos=True, n=2)
    one_ids = complete(client, prompt=ids[1], max_tokens=6, ignore_eos=True)
    assert [c["index"] for c in by_text["choices"]] == [0, 1, 2, 3]
    for body in (by_text, by_ids):
        for i, prompt in enumerate(ids):
            want = detok(tok, reference_decode(models["tiny"], prompt, 6)[0])
            assert [c["text"] for c in body["choices"][2 * i: 2 * i + 2]] == [want, want]
    assert one_ids["choices"][0]["text"] == by_ids["choices"][2]["text"]
    assert by_text["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert by_text["usage"]["completion_tokens"] == 24


def test_logprobs_match_the_model(client, server, models):
    tok = server.state.tokenizer
    body = complete(client, prompt=PROMPT, max_tokens=5, ignore_eos=True, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    tokens, ref = reference_decode(models["tiny"], tok.encode(PROMPT), 5, top_k=3)
    assert lp["tokens"] == [tok.decode([t]) for t in tokens]
    for got, (want, top) in zip(lp["token_logprobs"], ref):
        assert math.isclose(got, want, abs_tol=1e-4)
    for got, (_, top) in zip(lp["top_logprobs"], ref):
        assert set(got) <= {tok.decode([t]) for t, _ in top} and len(got) <= 3
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_seeded_sampling_n(client):
    body = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3, ignore_eos=True)
    first = [c["text"] for c in complete(client, **body)["choices"]]
    again = [c["text"] for c in complete(client, **body)["choices"]]
    assert first == again and len(set(first)) == 3


def test_streaming_matches_non_streaming(client):
    body = {"model": "b", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        # Streamed completion chunks carry finish_reason null until the last
        # one (as OpenAI's API sends them); the schema is otherwise met.
        for choice in c["choices"]:
            if choice["finish_reason"] is None:
                choice = {**choice, "finish_reason": "stop"}
            validate_schema("CreateCompletionResponse", {**c, "choices": [choice]})
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == plain
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10 and chunks[-1]["choices"] == []


def test_with_the_openai_sdk(server):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                        _strict_response_validation=True)
    r = sdk.completions.create(model="c", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1 and isinstance(r.choices[0].text, str)


@pytest.mark.parametrize("extra, param", [
    ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10 ** 7]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
])
def test_bad_completion_requests(client, extra, param):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **extra})
    assert r.status_code == 400, r.text
    validate_schema("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param


def test_prompt_longer_than_the_context(client, server):
    limit = server.state.max_model_len
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5] * (limit + 3)})
    assert r.status_code == 400
    assert str(limit) in r.json()["error"]["message"] and str(limit + 3) in r.json()["error"]["message"]
