"""POST /tokenize and /detokenize (mola/server/routes/tokenize.py), as vLLM's:
the ids are the tokenizer's own (its chat template for messages, the prompt the
chat route sends to the model), for the base and its adapters alike; text comes
back from ids; bad input is a 4xx in OpenAI's envelope naming the field; the API
key guards them like every /v1 route."""

from __future__ import annotations

import asyncio

import pytest

from mola.errors import InvalidRequest
from mola.server.middleware import AuthMiddleware
from mola.server.protocol import MAX_TOKENIZE_CHARS, TokenizeRequest

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where do rivers go? 1234"},
            {"role": "assistant", "content": "To the sea."},
            {"role": "user", "content": "And then?"}]
PROMPT = "The capital of France is <|im_end|> Paris"


def tokenize(client, **body) -> dict:
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["tiny", "a", None])
def test_messages_tokenize_as_the_chat_template_and_the_chat_route_do(client, server, model):
    tok = server.state.tokenizer
    body = {"messages": MESSAGES} if model is None else {"model": model, "messages": MESSAGES}
    got = tokenize(client, **body)
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert got == {"count": len(expected), "max_model_len": 2048, "tokens": expected}
    r = client.post("/v1/chat/completions", json={"model": model or "tiny", "messages": MESSAGES,
                                                  "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == got["count"]
    # Without the generation prompt, and with the last message left open.
    bare = tokenize(client, **body, add_generation_prompt=False)
    assert bare["tokens"] == tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert len(bare["tokens"]) < got["count"]
    opened = tokenize(client, **{**body, "messages": MESSAGES[:3]}, add_generation_prompt=False,
                      continue_final_message=True)
    text = tok.apply_chat_template(MESSAGES[:3], tokenize=False, continue_final_message=True)
    assert text.endswith("To the sea.") and opened["tokens"] == tok.encode(text, add_special_tokens=False)


def test_a_prompt_tokenizes_as_completions_encode_it_and_comes_back(client, server):
    tok = server.state.tokenizer
    got = tokenize(client, model="b", prompt=PROMPT, return_token_strs=True)
    assert got["tokens"] == tok.encode(PROMPT) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert tok.convert_tokens_to_ids("<|im_end|>") in got["tokens"]  # a special token in the text is one id
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == got["count"]
    assert client.post("/detokenize", json={"model": "b", "tokens": got["tokens"]}).json() == {"prompt": PROMPT}
    chat = tokenize(client, messages=MESSAGES)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert client.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"shout": True}}, 400, "chat_template_kwargs.shout"),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {"shout": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": "yes"}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": [  # a text-only base
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}]},
     400, "messages[0].content[1].image_url.url"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [0] * (1 << 20 | 1)}, 400, "tokens"),
])
def test_bad_requests_are_4xx_naming_the_field(client, route, body, status, param):
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_the_text_tokenized_at_once_is_bounded():
    TokenizeRequest(prompt="x" * MAX_TOKENIZE_CHARS).check()
    with pytest.raises(InvalidRequest) as e:
        TokenizeRequest(prompt="x" * (MAX_TOKENIZE_CHARS + 1)).check()
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        TokenizeRequest(messages=[{"role": "user", "content": "x" * (MAX_TOKENIZE_CHARS + 1)}]).check()
    assert e.value.param == "messages"


@pytest.mark.parametrize("path, guarded", [("/tokenize", True), ("/detokenize", True), ("/v1/models", True),
                                           ("/health", False)])
def test_the_api_key_guards_them(path, guarded):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def status(headers) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
        asyncio.run(AuthMiddleware(app, api_key="k" * 16, admin_key=None, protect_metrics=False)(
            scope, None, send))
        return sent[0]["status"]

    assert status([]) == (401 if guarded else 200)
    assert status([(b"authorization", b"Bearer " + b"k" * 16)]) == 200
