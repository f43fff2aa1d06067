"""POST /v1/responses (server/routes/responses.py) on conftest's real server
and, for the echo's cases, in process over a scripted echo: every
response and every stream event against OpenAI's schemas; the output equals
the same conversation sent to /v1/chat/completions; previous_response_id
equals sending the items; a tool call round trip on the demo's echo base,
which turns a message into the call it spells; the OpenAI SDK; the store;
4xx envelopes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

import mola.demo.echo as demo
from mola.demo import echo_data
from mola.config import AdapterSpec

from helpers.schemas import typed_events, validate_schema, validate_stream_event
from helpers.scripted import InProcessServer, ScriptedEngine, echo_script, tokenizer_model

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
STORE_SIZE = 4


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """The demo's echo base (it answers a message with itself) and its adapters,
    with a small response store: in process, over a scripted engine that
    answers as the echo does (the protocol is the subject; test_demo_echo.py
    serves the real one)."""
    model_dir, adapters = demo.ensure_demo(tmp_path_factory.mktemp("mola-cache"))
    model = tokenizer_model(model_dir)
    engine = ScriptedEngine()
    engine.script = echo_script(engine, model.tokenizer, {
        str(Path(path).resolve()): echo_data.TASKS[demo.RECIPES[name].task] for name, path in adapters.items()})
    handle = InProcessServer(
        model, engine, served_model_name="mola-demo", max_loras=4, max_lora_rank=16,
        adapters=tuple(AdapterSpec(name, str(path)) for name, path in adapters.items()),
        max_stored_responses=STORE_SIZE,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def echo_client(echo):
    with echo.client(timeout=60) as c:
        yield c


def create(client, **body) -> dict:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    validate_schema("Response", r.json())
    return r.json()


def stream(client, **body) -> list[dict]:
    """The typed events of a streamed response, each checked against its
    schema; sequence numbers count up from 0 and deltas add up."""
    r = client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = typed_events(r.text)
    for e in events:
        validate_stream_event(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    for e in events:
        if e["type"] == "response.output_text.done":
            deltas = [d["delta"] for d in events if d["type"] == "response.output_text.delta"
                      and d["item_id"] == e["item_id"]]
            assert "".join(deltas) == e["text"]
    return events


def text_of(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message"
                   for p in item["content"])


def chat(client, messages, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "temperature": 0,
                                                  **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("extra", [
    {},
    {"instructions": "Be brief.", "temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"model": "c", "lora_scale": 0.5, "metadata": {"k": "v"}, "user": "u1", "store": False},
    {"adapters": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.5}], "tools": TOOLS},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
     "max_output_tokens": 3},
])
def test_responses_and_every_stream_event_fit_the_spec(client, extra):
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0, **extra}
    done = create(client, **body)
    assert done["object"] == "response" and done["model"] == body["model"]
    assert done["status"] in ("completed", "incomplete") and done["usage"]["output_tokens"] >= 1
    assert done["metadata"] == body.get("metadata", {}) and done["store"] is body.get("store", True)
    events = stream(client, **body)
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert last["response"]["id"] == events[0]["response"]["id"]
    assert last["response"]["usage"]["output_tokens"] == done["usage"]["output_tokens"]
    kinds = [e["type"] for e in events]
    if done["output"][0]["type"] == "message":
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]


def test_max_output_tokens_makes_an_incomplete_response(client):
    done = create(client, model="tiny", input="Hello", max_output_tokens=2, ignore_eos=True)
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["usage"]["output_tokens"] == 2 and done["output"][0]["status"] == "incomplete"
    assert done["completed_at"] is None


@pytest.mark.parametrize("model", ["tiny", "b"])
def test_the_output_is_that_of_the_same_chat(client, model):
    """At temperature 0, a response equals the chat completion of the same
    messages (instructions as the system message), tokens and text."""
    done = create(client, model=model, instructions="You are terse.", input="Hello there",
                  max_output_tokens=8, temperature=0)
    ref = chat(client, [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Hello there"}], model=model, max_tokens=8)
    assert text_of(done) == ref["choices"][0]["message"]["content"]
    assert done["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert done["usage"]["output_tokens"] == ref["usage"]["completion_tokens"]


def test_previous_response_id_equals_sending_the_items(client):
    """Turn 2 through previous_response_id equals turn 2 with turn 1's input
    and output sent back as items, and the chat of the same messages; the
    first turn's instructions are not carried over."""
    first = create(client, model="tiny", input="Hello", instructions="Answer.", max_output_tokens=6,
                   temperature=0)
    second = create(client, model="tiny", input="And then?", previous_response_id=first["id"],
                    max_output_tokens=6, temperature=0)
    assert second["previous_response_id"] == first["id"]
    items = [{"role": "user", "content": "Hello"}, *first["output"], {"role": "user", "content": "And then?"}]
    stateless = create(client, model="tiny", input=items, max_output_tokens=6, temperature=0)
    ref = chat(client, [{"role": "user", "content": "Hello"},
                        {"role": "assistant", "content": text_of(first)},
                        {"role": "user", "content": "And then?"}], max_tokens=6)
    alone = create(client, model="tiny", input="And then?", max_output_tokens=6, temperature=0)
    assert text_of(second) == text_of(stateless) == ref["choices"][0]["message"]["content"]
    tokens = second["usage"]["input_tokens"]
    assert tokens == stateless["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert second["usage"]["input_tokens"] > alone["usage"]["input_tokens"]
    streamed = stream(client, model="tiny", input="And then?", previous_response_id=first["id"],
                      max_output_tokens=6, temperature=0)
    assert text_of(streamed[-1]["response"]) == text_of(second)


def test_function_call_items_render_as_chat_tool_messages(client):
    """Input items with a function_call and its output give the prompt and
    the output of chat's assistant tool_calls + tool message."""
    items = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    done = create(client, model="tiny", input=items, tools=TOOLS, max_output_tokens=8, temperature=0)
    ref = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
               tools=CHAT_TOOLS, max_tokens=8)
    assert done["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert text_of(done) == (ref["choices"][0]["message"]["content"] or "")
    other = create(client, model="tiny", input=[*items[:2], {**items[2], "output": "rain"}], tools=TOOLS,
                   max_output_tokens=8, temperature=0)
    assert other["usage"]["input_tokens"] != done["usage"]["input_tokens"]


def test_tool_call_round_trip(echo, echo_client):
    """The echo base answers with the call its message spells: a
    function_call item out, streamed as function_call_arguments events; then
    its function_call_output in, via previous_response_id, equal to the same
    conversation sent as items and to the chat template's own rendering of
    it. (The follow-up leaves the tools out, which only shortens the prompt.)"""
    events = stream(echo_client, model="mola-demo", input=TOOL_CALL, tools=TOOLS, temperature=0)
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    first = events[-1]["response"]
    call, = first["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    assert events[4]["arguments"] == call["arguments"] and events[4]["name"] == "get_weather"
    assert events[2]["item"]["id"] == call["id"] and events[2]["item"]["arguments"] == ""

    answer = [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}]
    short = dict(model="mola-demo", temperature=0, max_output_tokens=16)
    second = create(echo_client, previous_response_id=first["id"], input=answer, **short)
    stateless = create(echo_client, input=[{"role": "user", "content": TOOL_CALL}, call, *answer], **short)
    rendered = echo.state.tokenizer.apply_chat_template([
        {"role": "user", "content": TOOL_CALL},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call["call_id"], "type": "function",
                                                             "function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny, 21 C"}], add_generation_prompt=True)
    assert second["usage"]["input_tokens"] == stateless["usage"]["input_tokens"] == len(rendered)
    assert text_of(second) == text_of(stateless) and second["usage"]["output_tokens"] == 16


def test_model_names_the_base_or_an_adapter(echo_client):
    ask = dict(input="hello world, how are you?", temperature=0)
    assert text_of(create(echo_client, model="mola-demo", **ask)) == "hello world, how are you?"
    assert text_of(create(echo_client, model="upper", **ask)) == "HELLO WORLD, HOW ARE YOU?"
    assert text_of(create(echo_client, model="upper", lora_scale=0.0, **ask)) == "hello world, how are you?"
    stacked = create(echo_client, model="mola-demo", adapters=[{"name": "title", "scale": 1.0}], **ask)
    assert text_of(stacked) == "Hello World, How Are You?"
    behind = create(echo_client, model="upper", instructions="Shout.", **ask)
    assert text_of(behind) == "HELLO WORLD, HOW ARE YOU?"


def test_the_openai_sdk(echo):
    sdk = openai.OpenAI(base_url="http://mola/v1", api_key="x", max_retries=0,
                        _strict_response_validation=True, http_client=echo.client())
    r = sdk.responses.create(model="upper", input="mola on MLX", temperature=0)
    assert r.output_text == "MOLA ON MLX" and r.status == "completed" and r.usage.output_tokens > 0
    kinds = [e.type for e in sdk.responses.create(model="title", input="mola on mlx", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    with sdk.responses.stream(model="title", input="streamed word by word") as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == "Streamed Word By Word"

    r = sdk.responses.create(model="mola-demo", input=TOOL_CALL, tools=TOOLS, temperature=0)
    call = r.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert sdk.responses.retrieve(r.id).output[0].call_id == call.call_id


def test_the_store_keeps_the_last_used_and_says_what_is_gone(echo_client):
    unsaved = create(echo_client, model="mola-demo", input="hi", store=False)
    r = echo_client.get(f"/v1/responses/{unsaved['id']}")
    assert r.status_code == 404 and "store: false" in r.json()["error"]["message"]
    r = echo_client.post("/v1/responses", json={"model": "mola-demo", "input": "x",
                                                "previous_response_id": unsaved["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    validate_schema("ErrorResponse", r.json())

    ids = [create(echo_client, model="mola-demo", input=f"n{i}")["id"] for i in range(STORE_SIZE)]
    assert echo_client.get(f"/v1/responses/{ids[0]}").json()["id"] == ids[0]  # now the most recent
    newer = create(echo_client, model="mola-demo", input="one more")["id"]
    assert echo_client.get(f"/v1/responses/{ids[0]}").status_code == 200
    gone = echo_client.get(f"/v1/responses/{ids[1]}")  # the least recently used went
    assert gone.status_code == 404 and "evicted" in gone.json()["error"]["message"]
    r = echo_client.post("/v1/responses", json={"model": "mola-demo", "input": "x",
                                                "previous_response_id": ids[1]})
    assert r.status_code == 404 and "evicted" in r.json()["error"]["message"]
    follow = create(echo_client, model="mola-demo", input="x", previous_response_id=newer)
    assert follow["status"] == "completed"


@pytest.mark.parametrize("patch, status, param", [
    ({"model": "nope"}, 404, "model"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0].image_url"),  # a text-only base: the 400 names the image
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [], "content": "x"}]}, 400, "input[0].content"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"n": 2}, 400, "n"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}}}, 400,
     "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "stop": ["}"]}, 400, "stop"),
    ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ({"background": True}, 400, "background"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include[0]"),
    ({"include": ["everything"]}, 400, "include[0]"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    # an output that answers no call (OpenAI: "No tool call found for function call output")
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "call_a", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_b", "output": "x"}]}, 400, "input[1].call_id"),
])
def test_bad_input_is_a_4xx_that_names_the_field(client, patch, status, param):
    r = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2, **patch})
    assert r.status_code == status, r.text
    validate_schema("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param, r.json()


def test_harmless_fields_are_accepted(client):
    done = create(client, model="tiny", input="Hi", max_output_tokens=2, metadata={"team": "a"}, user="u",
                  safety_identifier="s", prompt_cache_key="k", service_tier="auto", store=True,
                  include=["reasoning.encrypted_content"], reasoning={"effort": None}, truncation="disabled",
                  parallel_tool_calls=False, stream_options={"include_obfuscation": False}, top_logprobs=0)
    assert done["metadata"] == {"team": "a"} and done["user"] == "u"


def test_a_failure_mid_stream_is_response_failed(server):
    """A generation that fails after its stream began (the engine aborts the
    row) ends with response.failed carrying the error."""
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json=body) as r:
            blocks, buf = [], ""
            for chunk in r.iter_text():
                buf += chunk
                if buf.count("\n\n") >= 4 and not blocks:
                    blocks.append("aborted")
                    engine = server.engine  # the running rows, read on the engine thread
                    running = engine.call(lambda: [s.seq_id for s in engine.scheduler.running]).result(timeout=30)
                    for seq_id in running:
                        engine.abort(seq_id)
    events = typed_events(buf)
    for e in events:
        validate_stream_event(e)
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    error = last["response"]["error"]
    assert error["code"] == "server_error" and "abort" in error["message"]
    assert last["response"]["output"][0]["status"] == "incomplete"


def test_an_orphan_call_output_names_its_call_id(client):
    r = client.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 2, "input": [
        {"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}]})
    assert r.status_code == 400 and "No tool call found" in r.json()["error"]["message"], r.text
    assert "'call_nowhere'" in r.json()["error"]["message"]


@pytest.mark.parametrize("method, route", [
    ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"), ("POST", "/v1/adapters"), ("PUT", "/v1/adapters/x/weights"),
    ("POST", "/v1/images/generations"), ("POST", "/tokenize"),
])
def test_an_empty_body_is_a_400_that_says_so(client, method, route):
    r = client.request(method, route, content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "The request body is empty" in message and "None" not in message, message
