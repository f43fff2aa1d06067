"""Structured outputs through the server (routes/chat.py, completions.py,
mola/structured): the OpenAI SDK's parse() with a Pydantic model, forced
tool calls read back by the family's parser, json_object / json_schema on
/v1/completions, batch invariance among free rows and other adapters, and
400s naming what cannot be constrained; every body against OpenAI's schemas."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from helpers.schemas import sse_events, validate_schema
from helpers.servers import start_server
from helpers.tokenizers import MISTRAL_TEMPLATE, with_chat_template


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)
    happy: bool


PET = openai.lib._parsing._completions.type_to_response_format_param(Pet)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["Describe a pet.", "What is the weather like in Rome this week?", "hi"]


def body(model, question=QUESTIONS[0], **extra):
    return {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 80, **extra}


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


def check_calls(calls, names=tuple(PARAMS)):
    assert calls
    for call in calls:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


@pytest.mark.parametrize("model", ["tiny", "a", "c"])
def test_sdk_parse_with_a_pydantic_model(sdk, model):
    for q in QUESTIONS:
        r = sdk.chat.completions.parse(model=model, messages=[{"role": "user", "content": q}],
                                       response_format=Pet, temperature=0, max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_body_and_stream_fit_openais_schemas(client):
    r = client.post("/v1/chat/completions", json=body("b", response_format=PET, n=2, temperature=1.0, seed=4))
    assert r.status_code == 200, r.text
    validate_schema("CreateChatCompletionResponse", r.json())
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        Pet.model_validate_json(choice["message"]["content"])
    r = client.post("/v1/chat/completions", json=body("b", response_format=PET, stream=True))
    events = sse_events(r.text)
    text = ""
    for e in events[:-1]:
        validate_schema("CreateChatCompletionStreamResponse", e)
        text += e["choices"][0]["delta"].get("content") or ""
    Pet.model_validate_json(text)


def test_length_leaves_a_valid_prefix(client, server):
    r = client.post("/v1/chat/completions", json=body("a", response_format=PET, max_tokens=5)).json()
    assert r["choices"][0]["finish_reason"] == "length"
    text = r["choices"][0]["message"]["content"]
    tok = server.state.tokenizer
    matcher = server.state.structured.for_request(response_format=PET).new_constraint().matcher
    ids = tok.encode(text, add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_accepting()


def test_required_tool_call_with_the_sdk(sdk):
    r = sdk.chat.completions.create(model="a", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                    tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls([c.model_dump() for c in choice.message.tool_calls])
    # streamed: the same calls
    stream = sdk.chat.completions.create(model="a", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                         tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
                                         stream=True)
    streamed, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            streamed += [call.model_dump() for call in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [c["function"] for c in streamed] == [c.function.model_dump() for c in choice.message.tool_calls]


def test_named_function_and_parallel_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for q in QUESTIONS:
        r = client.post("/v1/chat/completions", json=body("c", q, tools=TOOLS, tool_choice=named,
                                                          parallel_tool_calls=False, max_tokens=120))
        validate_schema("CreateChatCompletionResponse", r.json())
        message = r.json()["choices"][0]["message"]
        assert len(message["tool_calls"]) == 1
        check_calls(message["tool_calls"], names=("get_time",))


def test_completions_take_response_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    for fmt, check in (({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
                        lambda v: jsonschema.validate(v, schema)),
                       ({"type": "json_object"}, lambda v: isinstance(v, dict) or pytest.fail(v))):
        r = client.post("/v1/completions", json={"model": "b", "prompt": ["Hello", "The sea is"], "n": 2,
                                                 "max_tokens": 200, "temperature": 1.0, "seed": 1,
                                                 "response_format": fmt})
        assert r.status_code == 200, r.text
        validate_schema("CreateCompletionResponse", r.json())
        for choice in r.json()["choices"]:
            if choice["finish_reason"] == "stop" or fmt["type"] == "json_schema":
                assert choice["finish_reason"] == "stop"
                check(json.loads(choice["text"]))


def test_constrained_rows_do_not_depend_on_the_batch(server):
    jobs = [body(m, q, response_format=PET) for m in ("tiny", "a") for q in QUESTIONS]
    jobs += [body("b", q, tools=TOOLS, tool_choice="required", max_tokens=120) for q in QUESTIONS]
    jobs += [body(m, q, max_tokens=30) for m in ("c", "tiny") for q in QUESTIONS]  # free rows

    async def go(bodies):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
            return [r.json()["choices"][0]["message"] for r in rs]

    alone = [asyncio.run(go([b]))[0] for b in jobs]
    together = asyncio.run(go(jobs))
    strip = [{k: v for k, v in m.items() if k != "tool_calls"} | {"calls": [c["function"] for c in
                                                                          m.get("tool_calls") or []]}
             for m in together]
    assert strip == [{k: v for k, v in m.items() if k != "tool_calls"} | {"calls": [c["function"] for c in
                                                                                m.get("tool_calls") or []]}
                     for m in alone]
    assert server.engine.snapshot.stats.masked_steps > 0


@pytest.mark.parametrize("extra, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}, "required": ["a"],
        "additionalProperties": False}}}), "response_format", "'allOf'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}), "response_format", "additionalProperties"),
    (dict(response_format=PET, stop=["}"]), "stop", "stop string"),
    (dict(response_format=PET, ignore_eos=True), "ignore_eos", "ignore_eos"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "format": "phone"}}}}}], tool_choice="required"),
     "tools[0].function.parameters", "'phone'"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
])
def test_what_cannot_be_constrained_is_a_400_naming_it(client, extra, param, words):
    r = client.post("/v1/chat/completions", json=body("tiny", **extra))
    assert r.status_code == 400, r.text
    validate_schema("ErrorResponse", r.json())
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert client.post("/v1/chat/completions", json=body("tiny", response_format=PET)).status_code == 200


def test_completions_refuse_a_bad_format(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                             "response_format": {"type": "json_schema"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_a_mistral_family_model_calls_in_its_own_syntax(tiny_model, tmp_path):
    model = with_chat_template(tiny_model, tmp_path / "mistral", MISTRAL_TEMPLATE)
    handle = start_server(model=str(model), served_model_name="m")
    try:
        sdk = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        for q in QUESTIONS:
            r = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], tools=TOOLS,
                                            tool_choice="required", temperature=0, max_tokens=120)
            assert r.choices[0].finish_reason == "tool_calls"
            check_calls([c.model_dump() for c in r.choices[0].message.tool_calls])
    finally:
        handle.stop()


def test_responses_api_text_format_and_forced_calls_with_the_sdk(sdk, client):
    """/v1/responses hands text.format and tool_choice to the same grammars."""
    r = sdk.responses.parse(model="a", input=QUESTIONS[0], text_format=Pet, temperature=0, max_output_tokens=80)
    assert r.status == "completed" and isinstance(r.output_parsed, Pet)
    raw = client.post("/v1/responses", json={"model": "b", "input": QUESTIONS[2], "temperature": 0,
                                             "max_output_tokens": 80, "text": {"format": {
                                                 "type": "json_schema", "name": "pet", "strict": True,
                                                 "schema": PET["json_schema"]["schema"]}}}).json()
    validate_schema("Response", raw)
    Pet.model_validate_json(raw["output"][0]["content"][0]["text"])
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    r = sdk.responses.create(model="c", input=QUESTIONS[1], tools=tools, temperature=0, max_output_tokens=120,
                             tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS["get_weather"])
