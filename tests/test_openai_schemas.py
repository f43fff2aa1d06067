"""Every OpenAI endpoint's responses and stream chunks against OpenAI's
official schemas (tests/data/openai_schemas.json, extracted from OpenAI's
openapi.yaml with `nullable: true` read as "may be null")."""

from __future__ import annotations

import httpx
import jsonschema
import openai
import pytest

from helpers.schemas import sse_events, validate_schema

MSG = [{"role": "user", "content": "Hello"}]


def stream(client, path, body):
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_the_validator_rejects_what_the_schema_forbids():
    good = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    validate_schema("ErrorResponse", good)
    with pytest.raises(jsonschema.ValidationError):
        validate_schema("ErrorResponse", {"error": {"message": "m", "type": "t"}})  # param, code required
    with pytest.raises(jsonschema.ValidationError):
        validate_schema("CreateChatCompletionResponse", {"id": "x", "object": "chat.completion",
                        "created": 1, "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "x", "refusal": None}}]})  # no logprobs


@pytest.mark.parametrize("extra", [
    {},
    {"n": 2, "temperature": 0.8, "seed": 1},
    {"logprobs": True, "top_logprobs": 3},
    {"stop": ["e"], "model": "b"},
    {"adapters": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.5}]},
    {"model": "c", "lora_scale": 0.3, "frequency_penalty": 0.5, "logit_bias": {"5": -3}},
])
def test_chat(client, extra):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 5, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    validate_schema("CreateChatCompletionResponse", r.json())
    chunks = stream(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for c in chunks:
        validate_schema("CreateChatCompletionStreamResponse", c)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    ends = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(ends) == body.get("n", 1)


def test_chat_with_the_sdk_in_strict_mode(server):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                        _strict_response_validation=True)
    for extra in ({}, {"n": 2}, {"logprobs": True, "top_logprobs": 2}, {"model": "a", "stop": "x"}):
        args = {"model": "tiny", "messages": MSG, "max_tokens": 4, **extra}
        r = sdk.chat.completions.create(**args)
        assert len(r.choices) == extra.get("n", 1)


@pytest.mark.parametrize("extra", [{}, {"n": 2, "prompt": ["a", "b"]}, {"logprobs": 2, "model": "a"}])
def test_completions(client, extra):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    validate_schema("CreateCompletionResponse", r.json())
    for c in stream(client, "/v1/completions", body):
        # Streamed chunks carry finish_reason null until the last one, as
        # OpenAI's API sends them; everything else follows the schema.
        c = {**c, "choices": [{**ch, "finish_reason": ch["finish_reason"] or "length"} for ch in c["choices"]]}
        validate_schema("CreateCompletionResponse", c)


def test_models(client):
    validate_schema("ListModelsResponse", client.get("/v1/models").json())
    for m in client.get("/v1/models").json()["data"]:
        validate_schema("Model", client.get(f"/v1/models/{m['id']}").json())


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": MSG}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": -1}),
    ("POST", "/v1/completions", {"model": "tiny"}),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
    ("GET", "/v1/models/nope", None),
    ("POST", "/v1/adapters", {"name": "a", "path": "/nonexistent"}),
    ("DELETE", "/v1/adapters/nope", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "nope"}),
    ("GET", "/v1/nowhere", None),
])
def test_errors(client, method, path, body):
    r = client.request(method, path, json=body)
    assert 400 <= r.status_code < 500
    validate_schema("ErrorResponse", r.json())


def test_error_inside_a_stream_is_an_error_event(server):
    """A generation that fails after its stream began (here: the engine
    aborts the row) ends with OpenAI's error object, then [DONE]."""
    body = {"model": "tiny", "messages": MSG, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            seen = [next(lines), next(lines)]
            running = server.engine.call(lambda: [s.seq_id for s in server.engine.scheduler.running]).result()
            for seq_id in running:
                server.engine.abort(seq_id)
            seen += list(lines)
    events = sse_events("\n\n".join(seen))
    assert events[-1] == "[DONE]"
    validate_schema("ErrorResponse", events[-2])
    assert "abort" in events[-2]["error"]["message"]
