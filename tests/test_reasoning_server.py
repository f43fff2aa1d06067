"""Thinking models through the server (--reasoning-parser, chat_template_kwargs,
reasoning_effort): reasoning_content in chat answers and stream deltas,
reasoning items and their events in the Responses API, reasoning_tokens in
usage, and structured outputs and forced tool calls that start after the
thinking. Every body and stream against OpenAI's schemas.

Two kinds of model drive it. The echo demo's base (it answers a message with
that message) under Qwen3's real template writes exactly the thinking it is
given. Tiny random models under the real Qwen3, DeepSeek-R1-distill and
gpt-oss templates (tests/data/templates/) are driven by their grammar and a
logit_bias on the end-of-thinking marker; their split is checked on the exact
text of the tokens they wrote."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from mola.frontend.reasoning import reasoning_format

from helpers.schemas import sse_events, typed_events, validate_schema, validate_stream_event
from helpers.scripted import InProcessServer, ScriptedEngine, echo_script, tokenizer_model
from helpers.servers import start_server
from helpers.tokenizers import with_added_tokens, with_chat_template

TEMPLATES = Path(__file__).parent / "data" / "templates"
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]
THOUGHT = "The user asks for the weather in Rome.\n"
ANSWER = '{"city": "Rome", "days": 3}'
MESSAGE = f"<think>\n{THOUGHT}</think>\n\n{ANSWER}"  # what the echo writes back
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMA}}
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}  # the echo's vocabulary has no <think>


# ---- the echo under Qwen3's template: exact thinking -------------------------------------------


@pytest.fixture(scope="module")
def server(echo_demo, tmp_path_factory):
    base, _ = echo_demo
    model = with_chat_template(base, tmp_path_factory.mktemp("echo") / "qwen3",
                               (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    # In process over a scripted echo (helpers/scripted.py): the split is the subject, and the echo's answer
    # is the message byte for byte whichever engine writes it.
    loaded = tokenizer_model(model)
    engine = ScriptedEngine()
    engine.script = echo_script(engine, loaded.tokenizer, {})
    handle = InProcessServer(loaded, engine, served_model_name="echo")
    assert handle.state.reasoning.name == "qwen3"  # auto, from the template
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client(timeout=120) as c:
        yield c


def chat(client, content=MESSAGE, **extra):
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": content}],
                                                  "temperature": 0, "max_tokens": 200, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_splits_the_thinking_from_the_answer(client):
    body = chat(client, **THINKING_ON)
    validate_schema("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]  # one token per byte: the thinking is its markers and text
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(f"<think>\n{THOUGHT}</think>".encode())
    assert usage["completion_tokens"] == len(MESSAGE.encode()) + 1  # and the end of turn
    # Thinking off (the template closes it in the prompt): the output is all answer.
    off = chat(client, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert off["reasoning_content"] is None and off["content"] == ANSWER
    assert chat(client, reasoning_effort="none")["choices"][0]["message"]["reasoning_content"] is None


def test_stream_deltas_carry_the_reasoning_first(client):
    r = client.post("/v1/chat/completions", json={
        "model": "echo", "messages": [{"role": "user", "content": MESSAGE}], "temperature": 0, "max_tokens": 200,
        "stream": True, "stream_options": {"include_usage": True}, **THINKING_ON})
    chunks = sse_events(r.text)
    assert chunks[-1] == "[DONE]"
    kinds, reasoning, content = [], "", ""
    for chunk in chunks[:-1]:
        validate_schema("CreateChatCompletionStreamResponse", chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                kinds.append("r")
                reasoning += delta["reasoning_content"]
            if delta.get("content"):
                kinds.append("c")
                content += delta["content"]
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert "".join(kinds).rstrip("c") == "r" * kinds.count("r")  # all reasoning, then all answer
    assert chunks[-2]["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(
        f"<think>\n{THOUGHT}</think>".encode())


def test_a_format_applies_after_the_thinking(client):
    body = chat(client, response_format=FORMAT, **THINKING_ON)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT  # free text: the grammar let it through
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    closed = chat(client, response_format=FORMAT, chat_template_kwargs={"enable_thinking": False})
    jsonschema.validate(json.loads(closed["choices"][0]["message"]["content"]), SCHEMA)


def test_max_tokens_counts_the_thinking(client):
    body = chat(client, max_tokens=20, **THINKING_ON)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 20
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 20
    assert choice["message"]["content"] == "" and THOUGHT.startswith(choice["message"]["reasoning_content"])


@pytest.mark.parametrize("extra, param, words", [
    ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo", "does not read 'foo'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     "server sets it"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "reads no reasoning effort"),
])
def test_what_the_template_cannot_take_is_a_400_naming_it(client, extra, param, words):
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi"}],
                                                  **extra})
    assert r.status_code == 400, r.text
    validate_schema("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_template_kwargs_are_bounded(client):
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi"}],
                                                  "chat_template_kwargs": {"enable_thinking": "x" * 9000}})
    assert r.status_code == 400 and "chat_template_kwargs" in r.text


def test_responses_return_a_reasoning_item(client):
    req = {"model": "echo", "input": MESSAGE, "max_output_tokens": 200, "temperature": 0, **THINKING_ON}
    body = client.post("/v1/responses", json=req).json()
    validate_schema("Response", body)
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == len(f"<think>\n{THOUGHT}</think>".encode())
    # the reasoning item is kept, and goes back in as input
    again = client.post("/v1/responses", json={**req, "previous_response_id": body["id"], "input": "hi"})
    assert again.status_code == 200, again.text
    sent_back = client.post("/v1/responses", json={**req, "input": [
        {"role": "user", "content": "hi"}, reasoning, message, {"role": "user", "content": "more"}]})
    assert sent_back.status_code == 200, sent_back.text


def test_responses_stream_reasoning_events(client):
    req = {"model": "echo", "input": MESSAGE, "max_output_tokens": 200, "temperature": 0, "stream": True,
           "reasoning": {"effort": "none", "summary": "auto"}, **THINKING_ON}
    events = typed_events(client.post("/v1/responses", json=req).text)
    names = [validate_stream_event(e) and e["type"] for e in events]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.reasoning_text.delta"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert deltas == done["text"] == THOUGHT
    first_text = names.index("response.output_text.delta")
    assert names.index("response.reasoning_text.done") < first_text
    final = events[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["reasoning"] == {"effort": "none", "summary": "auto"}


@pytest.mark.parametrize("reasoning, param", [({"effort": "high"}, "reasoning.effort"),
                                              ({"summary": "detailed"}, "reasoning.summary"),
                                              ({"effort": "max"}, "reasoning.effort")])
def test_responses_refuse_what_they_cannot_honour(client, reasoning, param):
    r = client.post("/v1/responses", json={"model": "echo", "input": "hi", "reasoning": reasoning})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- random models under the real templates ------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_models(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    think = ["<think>", "</think>"]
    return {
        "qwen3": with_added_tokens(tiny_model, root / "qwen3", think,
                                   template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()),
        "deepseek_r1": with_added_tokens(tiny_model, root / "r1", think, template=(
            TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()),
        "gpt_oss": with_added_tokens(tiny_model, root / "gpt-oss", HARMONY_TOKENS, special=True,
                                     eos=("<|return|>", "<|call|>"),
                                     template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()),
    }


@pytest.fixture(scope="module")
def served(thinking_models):
    """``served(name)``: a server of that thinking model, started on first use
    and shared by the module's tests (one per model)."""
    handles = {}

    def serve(name):
        if name not in handles:
            handles[name] = start_server(model=str(thinking_models[name]), served_model_name=name)
        return handles[name]
    yield serve
    for handle in handles.values():
        handle.stop()


def exact_text(choice) -> str:
    """What the model wrote, every token (special ones too), from its log-probabilities' bytes."""
    return bytes(b for t in choice["logprobs"]["content"] for b in t["bytes"]).decode("utf-8", "replace")


# (model, what ends the thinking, logit_bias on tokens by text, frequency_penalty, request)
DRIVEN = [
    ("qwen3", "</think>", {"</think>": 3}, 0.0, {"response_format": FORMAT}),
    ("deepseek_r1", "</think>", {"</think>": 3}, 0.0, {"response_format": FORMAT}),
    ("deepseek_r1", "</think>", {"</think>": 3}, 0.0,  # no tool syntax mola reads: bare JSON after the thinking
     {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}),
    ("gpt_oss", "<|end|>", {"an": 6, "<|end|>": 3}, 2.0, {"response_format": FORMAT}),
    ("gpt_oss", "<|end|>", {"<|channel|>": 4, "<|end|>": 3}, 2.0, {"tools": [WEATHER], "tool_choice": "required"}),
]


@pytest.mark.parametrize("name, end, bias, penalty, extra", DRIVEN)
def test_thinking_is_free_and_the_answer_is_constrained_on_real_templates(served, name, end, bias, penalty, extra):
    handle = served(name)
    fmt = handle.state.reasoning
    assert fmt.name == name  # auto
    tok = handle.state.tokenizer
    ids = {text: tok.encode(text, add_special_tokens=False)[0] for text in bias}
    req = {"model": name, "messages": [{"role": "user", "content": "Weather in Rome?"}], "temperature": 0,
           "max_tokens": 150, "logprobs": True, "frequency_penalty": penalty,
           "logit_bias": {str(ids[t]): v for t, v in bias.items()}, **extra}
    with httpx.Client(base_url=handle.url, timeout=120) as c:
        body = c.post("/v1/chat/completions", json=req).json()
        validate_schema("CreateChatCompletionResponse", body)
        choice = body["choices"][0]
        message = choice["message"]
        assert message["reasoning_content"]  # some free thinking came first
        if "tools" in extra:
            assert choice["finish_reason"] == "tool_calls" and message["content"] is None
            for call in message["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
        else:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(message["content"]), SCHEMA)
        # the split, on the exact text of the tokens
        text = exact_text(choice)
        parser = reasoning_format(name, tok).start(tok, tok.apply_chat_template(
            req["messages"], add_generation_prompt=True, tools=extra.get("tools"))).parser(tools=True)
        split = parser.feed(text) + parser.finish()
        assert split.reasoning == message["reasoning_content"]
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
        spent = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
        if end == "</think>":
            assert spent == tokens.index(end) + 1
            assert text.split(end, 1)[0].removeprefix("<think>").lstrip() == message["reasoning_content"]
        else:
            assert 0 < spent < len(tokens)
        # streamed, the same
        stream = sse_events(c.post("/v1/chat/completions", json={**req, "stream": True}).text)
        deltas = [ch["choices"][0]["delta"] for ch in stream[:-1] if ch["choices"]]
        for ch in stream[:-1]:
            validate_schema("CreateChatCompletionStreamResponse", ch)
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")


def test_gpt_oss_responses_reason_then_call(served):
    """gpt-oss: reasoning_effort reaches its template; the Responses API
    returns the analysis as a reasoning item before the harmony call."""
    handle = served("gpt_oss")
    tok = handle.state.tokenizer
    bias = {str(tok.convert_tokens_to_ids("<|channel|>")): 4, str(tok.convert_tokens_to_ids("<|end|>")): 3}
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": SCHEMA}]
    req = {"model": "gpt_oss", "input": "Weather in Rome?", "tools": tools, "tool_choice": "required",
           "temperature": 0, "max_output_tokens": 150, "frequency_penalty": 2.0, "logit_bias": bias}
    with httpx.Client(base_url=handle.url, timeout=120) as c:
        high = c.post("/v1/responses", json={**req, "reasoning": {"effort": "high"}, "max_output_tokens": 1})
        low = c.post("/v1/responses", json={**req, "reasoning": {"effort": "low"}, "max_output_tokens": 1})
        assert high.status_code == low.status_code == 200, high.text
        assert high.json()["usage"]["input_tokens"] == low.json()["usage"]["input_tokens"] + 1  # "high" vs "low"
        body = c.post("/v1/responses", json=req).json()
        validate_schema("Response", body)
        assert [i["type"] for i in body["output"]] == ["reasoning", "function_call"]
        assert body["output"][0]["content"][0]["text"]
        jsonschema.validate(json.loads(body["output"][1]["arguments"]), SCHEMA)
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
        events = typed_events(c.post("/v1/responses", json={**req, "stream": True}).text)
        for event in events:
            validate_stream_event(event)
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "function_call"]
        assert events[-1]["response"]["output"][1]["arguments"] == body["output"][1]["arguments"]
