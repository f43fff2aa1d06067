"""The HTTP API against a real uvicorn server on 127.0.0.1, with httpx and the
OpenAI SDK; outputs checked against plain mlx-lm on merged weights and
responses against OpenAI's official schemas (mola/server/)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from helpers.engines import num_unfinished, runner_stats
from helpers.references import greedy_tokens, merged_model
from helpers.schemas import sse_events, validate_schema
from helpers.servers import wait_until
from mola.blas import blas_in_use

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


def chat_body(model, question=QUESTION, **extra):
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                         _strict_response_validation=True, max_retries=0)


def reference(model, tok, question, max_tokens, ignore_eos=False):
    """(text, n_tokens, finish) of plain mlx-lm greedy decoding, detokenized
    the way mlx-lm streams text, cut at the first EOS (unless ignored), special
    tokens left out (skip_special_tokens)."""
    eos = set(tok.eos_token_ids)
    special = eos | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    tokens = greedy_tokens(model, prompt, max_tokens)
    if not ignore_eos and any(t in eos for t in tokens):
        tokens = tokens[: next(i for i, t in enumerate(tokens) if t in eos) + 1]
    detok = tok.detokenizer
    for t in tokens:
        if t not in special:
            detok.add_token(t)
    detok.finalize()
    return detok.text, len(tokens), "stop" if tokens[-1] in eos and not ignore_eos else "length"


@pytest.fixture(scope="module")
def expected(server, tiny_model, adapters):
    """model id -> question -> (text, n_tokens, finish), from merged weights."""
    out = {}
    for model_id, adapter in [("tiny", None), *((n, p) for n, p in adapters.items())]:
        model, _ = merged_model(tiny_model, [adapter] if adapter else [])
        out[model_id] = {
            q: reference(model, server.state.tokenizer, q, MAX_TOKENS)
            for q in (QUESTION, "Hello there", "Tell me a story about a cat")
        }
    return out


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    validate_schema("ErrorResponse", body)
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


# ---- chat completions --------------------------------------------------------


@pytest.mark.parametrize("model_id", ["tiny", "a", "b", "c"])
def test_chat_matches_reference(client, expected, model_id):
    resp = client.post("/v1/chat/completions", json=chat_body(model_id))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate_schema("CreateChatCompletionResponse", body)
    text, n_tokens, finish = expected[model_id][QUESTION]
    choice = body["choices"][0]
    assert choice["message"]["content"] == text
    assert choice["finish_reason"] == finish
    assert body["model"] == model_id
    usage = body["usage"]
    assert usage["completion_tokens"] == n_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + n_tokens
    assert resp.headers["content-type"].startswith("application/json")


def test_adapters_answer_differently(expected):
    assert len({expected[m][QUESTION][0] for m in ("tiny", "a", "b", "c")}) == 4


def test_openai_sdk_strict_validation(sdk, expected):
    for model_id in ("tiny", "a", "c"):
        r = sdk.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS, temperature=0,
        )
        assert r.choices[0].message.content == expected[model_id][QUESTION][0]
        assert r.usage.completion_tokens == expected[model_id][QUESTION][1]


def test_max_completion_tokens_and_list_content(client):
    body = chat_body("a", max_completion_tokens=3)
    del body["max_tokens"]
    body["messages"] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_output(client, expected):
    text, _, _ = expected["b"][QUESTION]
    stop = text[3:6]
    assert stop and text.find(stop) == 3
    resp = client.post("/v1/chat/completions", json=chat_body("b", stop=[stop, "zzzz-never"]))
    choice = resp.json()["choices"][0]
    assert choice["message"]["content"] == text[:3]
    assert choice["finish_reason"] == "stop"


def test_seed_reproduces_sampled_output(client):
    body = chat_body("c", temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    first = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    again = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    other = client.post("/v1/chat/completions", json={**body, "seed": 8}).json()
    assert first == again
    assert other["choices"][0]["message"]["content"] != first


# ---- streaming ---------------------------------------------------------------


def test_stream_chunks(client, expected):
    body = chat_body("a", stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        validate_schema("CreateChatCompletionStreamResponse", c)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1
    text, n_tokens, finish = expected["a"][QUESTION]
    assert finishing[0]["choices"][0]["finish_reason"] == finish
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == text
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n_tokens


def test_stream_with_sdk(sdk, expected):
    stream = sdk.chat.completions.create(
        model="b", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
    )
    parts, finishes = [], []
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finishes.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == expected["b"][QUESTION][0]
    assert [f for f in finishes if f] == [expected["b"][QUESTION][2]]


def test_stream_without_usage_has_no_usage_chunk(client):
    with client.stream("POST", "/v1/chat/completions", json=chat_body("c", stream=True)) as resp:
        events = sse_events(resp.read().decode())
    assert all("usage" not in c for c in events[:-1])
    assert all(c["choices"] for c in events[:-1])


# ---- batching ----------------------------------------------------------------


def test_mixed_adapters_share_decode_steps(server, expected):
    """Concurrent requests for the base and three adapters: every answer is
    its reference, and decode steps carried rows of several slots at once."""
    mixed_before = runner_stats(server.engine).mixed_steps

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            jobs = [(m, q) for q in expected["tiny"] for m in ("tiny", "a", "b", "c")]
            resps = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=chat_body(m, q)) for m, q in jobs)
            )
            return jobs, resps

    jobs, resps = asyncio.run(burst())
    for (m, q), r in zip(jobs, resps):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected[m][q][0], (m, q)
    stats = runner_stats(server.engine)
    assert stats.mixed_steps > mixed_before
    assert stats.max_slots_in_step >= 3


# ---- models ------------------------------------------------------------------


def test_models_list_parent_and_root(client, server, adapters):
    body = client.get("/v1/models").json()
    validate_schema("ListModelsResponse", body)
    cards = {m["id"]: m for m in body["data"]}
    assert set(cards) == {"tiny", "a", "b", "c"}
    assert cards["tiny"]["parent"] is None
    for name, path in adapters.items():
        assert cards[name]["parent"] == "tiny" and cards[name]["root"] == str(path)
    one = client.get("/v1/models/b").json()
    validate_schema("Model", one)
    assert one == cards["b"]
    assert_error(client.get("/v1/models/nope"), 404)


# ---- adapters over REST -------------------------------------------------------


def test_hot_load_use_unload(client, server, adapters, expected):
    free = client.get("/v1/adapters").json()["free_slots"]
    resp = client.post("/v1/adapters", json={"name": "hot", "path": str(adapters["c"])})
    assert resp.status_code == 200, resp.text
    assert resp.json()["rank"] == 16
    r = client.post("/v1/chat/completions", json=chat_body("hot")).json()
    assert r["choices"][0]["message"]["content"] == expected["c"][QUESTION][0]
    assert "hot" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    resp = client.delete("/v1/adapters/hot")
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    assert_error(client.post("/v1/chat/completions", json=chat_body("hot")), 404, "model")
    assert "hot" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert_error(client.delete("/v1/adapters/hot"), 404)
    wait_until(lambda: client.get("/v1/adapters").json()["free_slots"] == free, 5, "the slot to be freed")


def test_reloaded_name_serves_new_weights(client, adapters, expected):
    assert client.post("/v1/adapters", json={"name": "swap", "path": str(adapters["a"])}).status_code == 200
    first = client.post("/v1/chat/completions", json=chat_body("swap")).json()
    assert client.delete("/v1/adapters/swap").status_code == 200
    resp = client.post("/v1/adapters", json={"name": "swap", "path": str(adapters["b"])})
    assert resp.json()["version"] == 2
    second = client.post("/v1/chat/completions", json=chat_body("swap")).json()
    assert first["choices"][0]["message"]["content"] == expected["a"][QUESTION][0]
    assert second["choices"][0]["message"]["content"] == expected["b"][QUESTION][0]
    client.delete("/v1/adapters/swap")


def test_bad_adapter_loads_are_4xx_and_change_nothing(client, adapters, tmp_path, expected):
    before = client.get("/v1/adapters").json()
    assert_error(client.post("/v1/adapters", json={"name": "a", "path": str(adapters["b"])}), 409)
    assert_error(client.post("/v1/adapters", json={"name": "tiny", "path": str(adapters["b"])}), 409)
    assert_error(client.post("/v1/adapters", json={"name": "x", "path": str(tmp_path / "none")}), 404)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "adapter_config.json").write_text("{oops")
    err = assert_error(client.post("/v1/adapters", json={"name": "x", "path": str(tmp_path / "junk")}), 400)
    assert "not valid JSON" in err["message"]
    assert_error(client.post("/v1/adapters", json={"name": "x"}), 400, "path")
    assert_error(client.post("/v1/adapters", json={"name": "", "path": "p"}), 400, "name")
    after = client.get("/v1/adapters").json()
    assert after["free_slots"] == before["free_slots"]
    assert [a["name"] for a in after["data"]] == [a["name"] for a in before["data"]]
    r = client.post("/v1/chat/completions", json=chat_body("a")).json()
    assert r["choices"][0]["message"]["content"] == expected["a"][QUESTION][0]


def test_unload_drains_running_requests(server, client, adapters, tiny_model):
    """An unloaded adapter finishes the requests already running on its
    weights; new requests get 404; the slot frees afterwards."""
    assert client.post("/v1/adapters", json={"name": "drain", "path": str(adapters["b"])}).status_code == 200
    n = 400
    body = chat_body("drain", max_tokens=n, stream=True, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = next(l for l in lines if l.startswith("data: "))
            deleted = client.delete("/v1/adapters/drain").json()
            assert deleted["in_flight"] == 1
            assert_error(client.post("/v1/chat/completions", json=chat_body("drain")), 404)
            rest = "\n\n".join([first, *lines])
    events = sse_events(rest)
    # The whole answer came from adapter b, start to end.
    model, _ = merged_model(tiny_model, [adapters["b"]])
    text, _, finish = reference(model, server.state.tokenizer, QUESTION, n, ignore_eos=True)
    finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
    assert finishes[-1] == finish
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1] if c["choices"]) == text
    wait_until(lambda: all(a["name"] != "drain" for a in client.get("/v1/adapters").json()["data"]), 5,
               "the drained adapter to leave")


# ---- bad input ---------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (chat_body("tiny", temperature="hot"), "temperature"),
        (chat_body("tiny", temperature=5), "temperature"),
        (chat_body("tiny", max_tokens=0), "max_tokens"),
        (chat_body("tiny", top_p=0), "top_p"),
        (chat_body("tiny", stream="yes"), "stream"),
        ({**chat_body("tiny"), "messages": []}, "messages"),
        ({**chat_body("tiny"), "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({**chat_body("tiny"), "messages": "hello"}, "messages"),
        (chat_body("tiny", n=0), "n"),
        (chat_body("tiny", n=17), "n"),
        (chat_body("tiny", top_logprobs=3), "top_logprobs"),
        (chat_body("tiny", logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat_body("tiny", response_format={"type": "yaml"}), "response_format"),
        (chat_body("tiny", tool_choice={"type": "function", "function": {"name": "g"}},
                   tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
        (chat_body("tiny", logit_bias={"abc": 1}), "logit_bias"),
        (chat_body("tiny", logit_bias={"5": 500}), "logit_bias"),
        (chat_body("tiny", logit_bias={"99999999": 5}), "logit_bias"),
        (chat_body("tiny", presence_penalty=3), "presence_penalty"),
        (chat_body("tiny", lora_scale=0.5), "lora_scale"),
        (chat_body("tiny", adapters=[]), "adapters"),
        (chat_body("a", adapters=[{"name": "a", "scale": 1}]), "adapters"),
        (chat_body("tiny", stop=[""]), "stop"),
    ],
)
def test_invalid_requests_are_400(client, body, param):
    err = assert_error(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_malformed_bodies_are_400(client):
    for raw in (b"{bad json", b"", b"[1, 2]", b"null", b'"text"'):
        resp = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(resp, 400)


def test_image_content_is_refused(client):
    body = chat_body("tiny")
    body["messages"] = [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    err = assert_error(client.post("/v1/chat/completions", json=body), 400)
    assert "The model 'tiny' does not take images" in err["message"]


def test_unknown_model_and_route(client):
    assert_error(client.post("/v1/chat/completions", json=chat_body("gpt-4")), 404, "model")
    assert_error(client.get("/v1/nothing"), 404)


def test_context_length_exceeded(client, server):
    limit = server.state.max_model_len
    err = assert_error(client.post("/v1/chat/completions", json=chat_body("tiny", question="word " * limit)), 400)
    assert str(limit) in err["message"] and "tokens" in err["message"]
    err = assert_error(client.post("/v1/chat/completions", json=chat_body("tiny", max_tokens=limit)), 400)
    assert str(limit) in err["message"]


def test_server_keeps_serving_after_bad_input(client, server, expected):
    client.post("/v1/chat/completions", content=b"{{{", headers={"content-type": "application/json"})
    client.post("/v1/adapters", json={"name": 5, "path": []})
    r = client.post("/v1/chat/completions", json=chat_body("c"))
    assert r.json()["choices"][0]["message"]["content"] == expected["c"][QUESTION][0]
    health = client.get("/health").json()
    assert {k: health[k] for k in ("status", "blas")} == {"status": "ok", "blas": blas_in_use()}
    assert set(health["kv_cache"]) == {server.state.base_id}  # each loaded base's KV budget


def test_client_disconnect_frees_the_row(server):
    steps_before = runner_stats(server.engine).decode_steps
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body("a", max_tokens=1500, stream=True, ignore_eos=True)) as resp:
            lines = (l for l in resp.iter_lines() if l.startswith("data: "))
            next(lines), next(lines)  # the role chunk, then generated text
            assert num_unfinished(server.engine) == 1
    wait_until(lambda: num_unfinished(server.engine) == 0, 5, "the row to be freed")
    assert runner_stats(server.engine).decode_steps - steps_before < 1500  # cut short
    assert server.state.registry.get("a").in_flight == 0


def test_peft_and_gguf_twins_load_over_rest(client, adapters, tmp_path, expected, tiny_model):
    """The same LoRA as PEFT and as llama.cpp GGUF (q/k rows permuted the way
    llama.cpp stores them) answers exactly like its mlx-lm original."""
    import json as _json

    from mola.adapters.formats import read_adapter
    from mola.adapters.formats.gguf_writer import save_gguf_adapter
    from mola.testing.peft import save_peft_adapter

    weights = read_adapter(adapters["c"])
    config = _json.loads((tiny_model / "config.json").read_text())
    save_peft_adapter(tmp_path / "c-peft", weights)
    save_gguf_adapter(tmp_path / "c.gguf", weights, n_head=config["num_attention_heads"],
                      n_kv_head=config["num_key_value_heads"])
    for name, path, fmt in (("c-peft", tmp_path / "c-peft", "peft"), ("c-gguf", tmp_path / "c.gguf", "gguf")):
        r = client.post("/v1/adapters", json={"name": name, "path": str(path)})
        assert r.status_code == 200, r.text
        assert r.json()["format"] == fmt and r.json()["rank"] == 16
    for name in ("c-peft", "c-gguf"):
        out = client.post("/v1/chat/completions", json=chat_body(name)).json()
        assert out["choices"][0]["message"]["content"] == expected["c"][QUESTION][0]
    for name in ("c-peft", "c-gguf"):
        assert client.delete(f"/v1/adapters/{name}").status_code == 200
