"""The prompt cache through the server: usage.prompt_tokens_details.cached_tokens
(OpenAI's schemas), what /v1/adapters and /metrics report, and the adapter
identities of the registry -- unloads, reloads under the same name, changed
stacks -- never served another identity's KV state (outputs against
plain mlx-lm on merged weights)."""

from __future__ import annotations

from helpers.references import detokenize, merged_model, reference_decode
from helpers.schemas import sse_events, validate_schema

MAX_TOKENS = 6


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "You answer questions about rivers, briefly. " * 3},
            {"role": "user", "content": text}]


def chat(client, msgs, model="tiny", **extra) -> dict:
    body = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def expected(server, tiny_model, msgs, adapter_dirs=(), scales=None) -> str:
    model, _ = merged_model(tiny_model, list(adapter_dirs), scales)
    tok = server.state.tokenizer
    tokens, _ = reference_decode(model, tok.apply_chat_template(msgs, add_generation_prompt=True), MAX_TOKENS)
    return detokenize(tok, tokens, stop_at_eos=False)


def cache_stats(client) -> dict:
    return client.get("/v1/adapters").json()["prompt_cache"]


def test_usage_reports_cached_tokens(client):
    msgs = messages("Where does the Danube end?")
    first = chat(client, msgs, "b")
    validate_schema("CreateChatCompletionResponse", first)
    assert cached(first) == 0
    again = chat(client, msgs, "b")
    validate_schema("CreateChatCompletionResponse", again)
    n = again["usage"]["prompt_tokens"]
    assert cached(again) == n - 1  # all but the last prompt token, which decoding reads
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "b", "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = sse_events(r.read().decode())[:-1]
    for c in chunks:
        validate_schema("CreateChatCompletionStreamResponse", c)
    assert cached(chunks[-1]) == n - 1


def test_completions_report_cached_tokens_per_prompt(client):
    prompts = ["The Rhine rises in the Alps and", "The Nile floods every summer because"]
    body = {"model": "c", "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()
    validate_schema("CreateCompletionResponse", first)
    assert cached(first) == 0
    again = client.post("/v1/completions", json={**body, "n": 2}).json()
    validate_schema("CreateCompletionResponse", again)
    assert cached(again) == again["usage"]["prompt_tokens"] - len(prompts)
    with client.stream("POST", "/v1/completions", json={
            **body, "prompt": prompts[0], "stream": True, "stream_options": {"include_usage": True}}) as r:
        last = sse_events(r.read().decode())[-2]
    validate_schema("CreateCompletionResponse", last)
    assert cached(last) == last["usage"]["prompt_tokens"] - 1


def test_adapters_and_metrics_report_the_cache(server, client):
    chat(client, messages("Which river is the longest?"))
    chat(client, messages("Which river is the longest?"))
    stats = cache_stats(client)
    assert stats["enabled"] and stats["max_bytes"] == server.config.engine.prompt_cache_bytes
    assert 0 < stats["bytes"] <= stats["max_bytes"] and stats["entries"] >= 1
    assert stats["hits"] >= 1 and stats["misses"] >= 1 and stats["cached_tokens"] >= stats["hits"]
    text = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("mola_prompt_cache")}
    assert values["mola_prompt_cache_hits_total"] >= stats["hits"]
    assert values["mola_prompt_cache_cached_tokens_total"] >= stats["cached_tokens"]
    assert values["mola_prompt_cache_max_bytes"] == stats["max_bytes"]
    assert {"mola_prompt_cache_bytes", "mola_prompt_cache_entries", "mola_prompt_cache_misses_total",
            "mola_prompt_cache_evictions_total"} <= set(values)


def test_multi_turn_chat_reuses_the_earlier_turn(server, client, tiny_model, adapters):
    msgs = messages("Name a river in Spain.")
    one = chat(client, msgs, "a")
    msgs = msgs + [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                   {"role": "user", "content": "And one in Portugal?"}]
    two = chat(client, msgs, "a")
    assert cached(two) >= one["usage"]["prompt_tokens"] - 1
    assert two["choices"][0]["message"]["content"] == expected(server, tiny_model, msgs, [adapters["a"]])


def test_unloaded_then_reloaded_adapter_gets_no_stale_prefix(server, client, tiny_model, adapters):
    msgs = messages("How deep is the Volga?")
    assert client.post("/v1/adapters", json={"name": "swap", "path": str(adapters["a"])}).status_code == 200
    chat(client, msgs, "swap")
    assert cached(chat(client, msgs, "swap")) > 0
    before = cache_stats(client)
    assert client.delete("/v1/adapters/swap").status_code == 200
    after = cache_stats(client)  # the unload dropped its entries, and their memory
    assert after["entries"] < before["entries"] and after["bytes"] < before["bytes"]
    assert client.post("/v1/adapters", json={"name": "swap", "path": str(adapters["b"])}).status_code == 200
    body = chat(client, msgs, "swap")
    assert cached(body) == 0
    assert body["choices"][0]["message"]["content"] == expected(server, tiny_model, msgs, [adapters["b"]])
    again = chat(client, msgs, "swap")  # the new version caches its own
    assert cached(again) > 0 and again["choices"] == body["choices"]
    client.delete("/v1/adapters/swap")


def test_changed_stack_gets_no_stale_prefix(server, client, tiny_model, adapters):
    msgs = messages("Do rivers ever flow uphill?")
    first = chat(client, msgs, adapters=[{"name": "a"}, {"name": "b", "scale": 0.5}])
    assert cached(chat(client, msgs, adapters=[{"name": "b", "scale": 0.5}, {"name": "a"}])) > 0  # same sum
    other = chat(client, msgs, adapters=[{"name": "a"}, {"name": "b", "scale": 2.0}])
    assert cached(other) == 0
    want = expected(server, tiny_model, msgs, [adapters["a"], adapters["b"]], [1.0, 2.0])
    assert other["choices"][0]["message"]["content"] == want != first["choices"][0]["message"]["content"]


def test_responses_report_cached_input_tokens(client):
    body = {"model": "c", "instructions": "You answer questions about rivers, briefly. " * 3,
            "input": "Which river crosses Paris?", "max_output_tokens": MAX_TOKENS, "temperature": 0}
    first = client.post("/v1/responses", json=body).json()
    validate_schema("Response", first)
    assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
    second = client.post("/v1/responses", json={**body, "input": "And Rome?",
                                                 "previous_response_id": first["id"]}).json()
    validate_schema("Response", second)
    # the same instructions: turn 1's prompt (and reply) start turn 2's
    cached_two = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert first["usage"]["input_tokens"] - 1 <= cached_two < second["usage"]["input_tokens"]
    again = client.post("/v1/responses", json=body).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == first["usage"]["input_tokens"] - 1
