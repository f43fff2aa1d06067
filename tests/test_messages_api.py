"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens)
through the official `anthropic` SDK against a real mola server on 127.0.0.1
serving the echo demo (its base echoes the message; upper, title and count
are its adapters), with an API key. Answers are checked against the echo's
known behaviour and against what /v1/chat/completions answers for the same
conversation; every stream event against the SDK's own types. And the
conversion and event pieces without a server."""

from __future__ import annotations

import asyncio
import json
import typing
from types import SimpleNamespace

import anthropic
import httpx
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse

import mola.demo.echo as demo
from mola.config import AdapterSpec
from mola.errors import RequestTimedOut
from mola.server.anthropic.convert import stop_reason, to_chat_messages
from mola.server.anthropic.events import MessageBuilder, usage
from mola.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from mola.frontend.generation import Delta
from mola.server.dialects.messages import _complete, _stream
from mola.demo import echo_data

from helpers.schemas import typed_events
from helpers.scripted import InProcessServer, ScriptedEngine, echo_script, tokenizer_model
from helpers.servers import start_server

API = "sk-mola-test-key"
TASKS = {"mola-demo": lambda m: m, **{name: echo_data.TASKS[r.task] for name, r in demo.RECIPES.items()}}
HELLO = "hello world, how are you?"
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
T0 = {"temperature": 0}  # newer SDKs send sampling fields only through extra_body
RAW_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
ERROR = pydantic.TypeAdapter(ErrorResponse)


@pytest.fixture(scope="module")
def server(echo_demo):
    model_dir, adapters = echo_demo
    handle = start_server(
        model=str(model_dir), served_model_name="mola-demo", api_key=API,
        adapters=tuple(AdapterSpec(name, str(path)) for name, path in adapters.items()),
        max_loras=4, max_lora_rank=16,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API, max_retries=0, timeout=60)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(server, messages: list[dict], **extra) -> dict:
    """The OpenAI chat route's answer for the same conversation."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {API}"},
                   json={"model": "mola-demo", "messages": messages, "temperature": 0, "max_tokens": 200, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def post(server, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + "/v1/messages", content=content, timeout=60,
                      headers={"content-type": "application/json", "x-api-key": API, **headers})


def prompt_tokens(u) -> int:
    """Anthropic's input tokens are the sum of the uncached and the cached."""
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def comparable(message) -> dict:
    """A message without what differs between two answers of one request: its
    id and its tool_use ids, and how the prompt cache split the prompt tokens."""
    d = message.model_dump(exclude={"id", "usage"})
    d["content"] = [{k: v for k, v in b.items() if k not in ("parsed_output", "id")} for b in d["content"]]
    return {**d, "prompt_tokens": prompt_tokens(message.usage), "output_tokens": message.usage.output_tokens}


# ---- text ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(TASKS))
def test_each_model_answers_as_the_chat_route_does(server, client, model):
    m = client.messages.create(model=model, max_tokens=120, extra_body=T0, messages=user(HELLO))
    answer = chat(server, user(HELLO), model=model)
    assert [(b.type, b.text) for b in m.content] == [("text", TASKS[model](HELLO))]
    assert m.content[0].text == answer["choices"][0]["message"]["content"]
    assert (m.type, m.role, m.model, m.stop_reason, m.stop_sequence) == ("message", "assistant", model,
                                                                        "end_turn", None)
    assert m.id.startswith("msg_")
    assert prompt_tokens(m.usage) == answer["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == answer["usage"]["completion_tokens"]


def test_system_prompt_as_text_and_as_blocks(server, client):
    system = "You are a helpful assistant. Answer briefly."
    expected = chat(server, [{"role": "system", "content": system}, *user(HELLO)])
    for given in (system, [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]):
        m = client.messages.create(model="mola-demo", max_tokens=120, extra_body=T0, system=given,
                                   messages=user(HELLO))
        assert m.content[0].text == HELLO == expected["choices"][0]["message"]["content"]
        assert prompt_tokens(m.usage) == expected["usage"]["prompt_tokens"]
        count = client.messages.count_tokens(model="mola-demo", system=given, messages=user(HELLO))
        assert count.input_tokens == expected["usage"]["prompt_tokens"]


def test_count_tokens_is_what_a_request_reports(client):
    messages = user("mola serves many adapters at once")
    count = client.messages.count_tokens(model="upper", messages=messages).input_tokens
    for _ in range(2):  # the second is served from the prompt cache: the sum stays
        m = client.messages.create(model="upper", max_tokens=60, extra_body=T0, messages=messages)
        assert prompt_tokens(m.usage) == count
    assert m.usage.cache_read_input_tokens > 0 and m.usage.input_tokens < count


def test_stop_sequences(client, server):
    m = client.messages.create(model="mola-demo", max_tokens=120, extra_body=T0, messages=user(HELLO),
                               stop_sequences=["are", "world"])
    assert m.content[0].text == "hello " and m.stop_reason == "stop_sequence" and m.stop_sequence == "world"
    m = client.messages.create(model="mola-demo", max_tokens=120, extra_body=T0, messages=user(HELLO),
                               stop_sequences=["nowhere"])
    assert m.content[0].text == HELLO and (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    m = client.messages.create(model="mola-demo", max_tokens=3, extra_body=T0, messages=user(HELLO))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3 and HELLO.startswith(m.content[0].text)


def test_an_adapter_as_model_and_lora_scale_in_extra_body(server, client):
    for scale in (0.5, 0.0):
        m = client.messages.create(model="upper", max_tokens=120, messages=user(HELLO),
                                   extra_body={"lora_scale": scale, "temperature": 0})
        expected = chat(server, user(HELLO), model="upper", lora_scale=scale)["choices"][0]["message"]["content"]
        assert m.content[0].text == expected
    assert expected == HELLO  # scale 0: the base's echo
    m = client.messages.create(model="mola-demo", max_tokens=120, messages=user(HELLO),
                               extra_body={"adapters": [{"name": "upper", "scale": 1.0}], "temperature": 0})
    assert m.content[0].text == HELLO.upper()


def test_output_config_format_goes_through_the_grammar(server, client):
    schema = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
              "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
    content = '{"city": "paris", "unit": "celsius"}'
    m = client.messages.create(model="upper", max_tokens=120, messages=user(content),  # older SDKs lack output_config
                               extra_body={**T0, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    expected = chat(server, user(content), model="upper",
                    response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert m.content[0].text == expected["choices"][0]["message"]["content"]
    assert json.loads(m.content[0].text) == {"city": "PARIS", "unit": "celsius"}  # the enum holds under upper


def test_thinking_disabled_is_a_no_op_where_the_template_has_no_thinking(client):
    m = client.messages.create(model="mola-demo", max_tokens=120, messages=user(HELLO), extra_body=T0,
                               thinking={"type": "disabled"})
    assert m.content[0].text == HELLO


def test_top_k_one_is_greedy(client):
    m = client.messages.create(model="title", max_tokens=120, messages=user(HELLO),
                               extra_body={"temperature": 1.0, "top_k": 1})
    assert m.content[0].text == TASKS["title"](HELLO)


# ---- streaming -------------------------------------------------------------------------


def check_order(events: list[dict]) -> None:
    """message_start; blocks 0, 1, ... each start, deltas, stop; message_delta; message_stop."""
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    index, open_ = -1, False
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert not open_ and e["index"] == index + 1
            index, open_ = e["index"], True
        else:
            assert open_ and e["index"] == index and e["type"] in ("content_block_delta", "content_block_stop")
            open_ = e["type"] == "content_block_delta"
    assert not open_
    assert events[0]["message"]["stop_reason"] is None and events[0]["message"]["content"] == []


@pytest.mark.parametrize("model, kwargs", [
    ("title", {}),
    ("mola-demo", {"stop_sequences": ["how"]}),
    ("mola-demo", {"tools": TOOLS, "content": TOOL_CALL}),
])
@pytest.mark.slow
def test_stream_events_are_the_sdks_types_in_order_and_end_as_the_plain_answer(server, client, model, kwargs):
    kwargs = dict(kwargs)
    messages = user(kwargs.pop("content", HELLO))
    plain = client.messages.create(model=model, max_tokens=200, extra_body=T0, messages=messages, **kwargs)

    with client.messages.stream(model=model, max_tokens=200, extra_body=T0, messages=messages, **kwargs) as s:
        helper_types = {e.type for e in s}  # the raw events and the helper's own (text, input_json, ...)
        final = s.get_final_message()
    assert comparable(final) == comparable(plain)
    assert {"message_start", "content_block_start", "message_stop"} <= helper_types

    raw = list(client.messages.create(model=model, max_tokens=200, extra_body=T0, messages=messages, stream=True,
                                      **kwargs))
    members = typing.get_args(typing.get_args(RawMessageStreamEvent)[0])
    assert raw and all(isinstance(e, members) for e in raw)  # as the SDK parsed them

    r = post(server, {"model": model, "max_tokens": 200, "temperature": 0, "messages": messages, "stream": True,
                      **kwargs})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = typed_events(r.text)
    for e in events:
        RAW_EVENT.validate_python(e)  # strictly: a field of the wrong type fails
    check_order(events)
    assert events[-2]["delta"]["stop_reason"] == plain.stop_reason
    assert events[-2]["usage"]["output_tokens"] == plain.usage.output_tokens


def test_a_streamed_tool_use_assembles_its_input(server):
    r = post(server, {"model": "mola-demo", "max_tokens": 200, "temperature": 0, "stream": True,
                      "tools": TOOLS, "messages": user(TOOL_CALL)})
    events = typed_events(r.text)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["content_block"]["type"] for e in starts] == ["tool_use"]
    assert starts[0]["content_block"]["name"] == "get_weather" and starts[0]["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


# ---- tools ---------------------------------------------------------------------------------


def test_tool_use_and_a_tool_result_round_trip(server, client):
    m = client.messages.create(model="mola-demo", max_tokens=200, extra_body=T0, tools=TOOLS,
                               messages=user(TOOL_CALL))
    call = chat(server, user(TOOL_CALL), tools=CHAT_TOOLS)["choices"][0]["message"]["tool_calls"][0]
    (block,) = m.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert json.loads(call["function"]["arguments"]) == block.input and call["function"]["name"] == block.name
    assert m.stop_reason == "tool_use" and block.id.startswith("toolu_")

    answer = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}
    messages = [*user(TOOL_CALL), answer, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    chat_messages = [*user(TOOL_CALL),
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": block.id, "type": "function",
                          "function": {"name": "get_weather", "arguments": json.dumps(block.input)}}]},
                     {"role": "tool", "tool_call_id": block.id, "content": "sunny, 21 C"}]
    expected = chat(server, chat_messages, tools=CHAT_TOOLS)
    again = client.messages.create(model="mola-demo", max_tokens=200, extra_body=T0, tools=TOOLS, messages=messages)
    count = client.messages.count_tokens(model="mola-demo", tools=TOOLS, messages=messages).input_tokens
    assert count == prompt_tokens(again.usage) == expected["usage"]["prompt_tokens"]
    calls = expected["choices"][0]["message"]["tool_calls"]
    assert [(b.name, b.input) for b in again.content] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_tool_choice_forces_a_call_through_the_grammar(server, client):
    content = '{"city": "Paris"}'  # the echo writes it; the grammar makes it a call
    m = client.messages.create(model="mola-demo", max_tokens=200, extra_body=T0, tools=TOOLS, messages=user(content),
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    expected = chat(server, user(content), tools=CHAT_TOOLS, parallel_tool_calls=False,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = expected["choices"][0]["message"]["tool_calls"][0]
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather",
                                                               json.loads(call["function"]["arguments"]))]
    assert m.stop_reason == "tool_use"
    m = client.messages.create(model="mola-demo", max_tokens=200, extra_body=T0, tools=TOOLS, messages=user(content),
                               tool_choice={"type": "none"})
    assert m.content[0].text == content and m.stop_reason == "end_turn"


class FakeGeneration:
    """What routes/messages.py reads of a Generation, yielding given deltas;
    records whether the route left them early (which aborts a real row)."""

    def __init__(self, deltas):
        self._deltas = deltas
        self.num_prompt_tokens, self.num_cached_tokens, self.num_tokens = 9, 0, 0
        self.finish_reason = None
        self.text = SimpleNamespace(stop_string=None)
        self.left_early = False

    async def deltas(self):
        try:
            for d in self._deltas:
                if isinstance(d, Exception):
                    raise d
                self.num_tokens += len(d.tokens)
                self.finish_reason = d.finish_reason
                yield d
        except GeneratorExit:
            self.left_early = True
            raise


def test_disable_parallel_tool_use_ends_the_message_at_its_first_call():
    """(The echo cannot write two calls in one answer: its copy follows the
    last occurrence of what it just wrote.)"""
    def call(city):
        return {"id": f"call_{city}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}

    deltas = [Delta(0, "", [1, 2], tool_calls=[call("Paris")]), Delta(0, "", [3], tool_calls=[call("Oslo")]),
              Delta(0, "", [4], finish_reason="tool_calls")]
    for one, cities, left_early in ((False, ["Paris", "Oslo"], False), (True, ["Paris"], True)):
        body = MessagesRequest(model="m", max_tokens=9, messages=user("x"), tools=TOOLS,
                               tool_choice={"type": "auto", "disable_parallel_tool_use": one})
        gen, builder = FakeGeneration(deltas), MessageBuilder("m")
        asyncio.run(_complete(gen, builder, body))
        assert [b["input"]["city"] for b in builder.message["content"]] == cities
        assert builder.message["stop_reason"] == "tool_use" and gen.left_early == left_early
        assert builder.message["usage"]["output_tokens"] == (2 if one else 4)


def test_a_stream_that_fails_part_way_ends_with_an_error_event():
    class Connected:
        async def is_disconnected(self):
            return False

    async def collect(gen):
        body = MessagesRequest(model="m", max_tokens=9, messages=user("x"))
        return [chunk async for chunk in _stream(gen, MessageBuilder("m"), body, False, Connected())]

    late = RequestTimedOut("The request waited longer than --request-timeout (1 s) for the model; try again later.")
    chunks = asyncio.run(collect(FakeGeneration([Delta(0, "he", [1]), late])))
    events = typed_events("".join(chunks))
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    error = ERROR.validate_python(events[-1])
    assert error.error.type == "timeout_error" and "--request-timeout" in error.error.message


# ---- thinking ---------------------------------------------------------------------------------

THOUGHT = "<think>I ponder the sky</think>It is blue"  # the echo writes it; the qwen3 parser splits it


@pytest.fixture(scope="module")
def thinking_server(echo_demo):
    """The echo base with Qwen3's reasoning parser, in process over the scripted
    echo (helpers/scripted.py): the blocks are the subject, not the model."""
    model_dir, _ = echo_demo
    model = tokenizer_model(model_dir)
    engine = ScriptedEngine()
    engine.script = echo_script(engine, model.tokenizer, {})
    handle = InProcessServer(model, engine, served_model_name="mola-demo", reasoning_parser="qwen3")
    yield handle
    handle.stop()


class Httpx2Onto:
    """The anthropic SDK's transport (it speaks httpx2) onto an httpx client of the app."""

    def __init__(self, http):
        import httpx2

        self.http, self.httpx2 = http, httpx2

    def sdk(self) -> anthropic.Anthropic:
        onto = self

        class Transport(self.httpx2.BaseTransport):
            def handle_request(self, request):
                r = onto.http.request(request.method, str(request.url), headers=request.headers.raw,
                                      content=request.read())
                return onto.httpx2.Response(r.status_code, headers=r.headers.raw, content=r.content)
        return anthropic.Anthropic(base_url="http://mola", api_key="unused", max_retries=0, timeout=60,
                                   http_client=self.httpx2.Client(transport=Transport()))


def test_thinking_blocks_hold_what_chat_calls_reasoning_content(thinking_server):
    http = thinking_server.client(timeout=60)
    client = Httpx2Onto(http).sdk()
    r = http.post("/v1/chat/completions", json={
        "model": "mola-demo", "messages": user(THOUGHT), "temperature": 0, "max_tokens": 200})
    expected = r.json()
    m = client.messages.create(model="mola-demo", max_tokens=200, messages=user(THOUGHT), extra_body=T0)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "I ponder the sky"), ("text", "It is blue")]
    message = expected["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("I ponder the sky", "It is blue")
    assert m.model_dump()["usage"]["output_tokens_details"]["thinking_tokens"] == \
        expected["usage"]["completion_tokens_details"]["reasoning_tokens"]

    r = http.post("/v1/messages", json={
        "model": "mola-demo", "max_tokens": 200, "temperature": 0, "stream": True, "messages": user(THOUGHT)})
    events = typed_events(r.text)
    for e in events:
        RAW_EVENT.validate_python(e)
    check_order(events)
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert kinds[-1] == "text_delta" and kinds.index("signature_delta") == kinds.index("text_delta") - 1
    assert "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta") == \
        "I ponder the sky"

    # Sent back, a thinking block is taken and the prompt is chat's (the echo's template reads no
    # reasoning_content; test_a_conversation_becomes_chat_messages checks that it is carried).
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}
    messages = [*user(THOUGHT), turn, *user("and the sea?")]
    count = client.messages.count_tokens(model="mola-demo", messages=messages).input_tokens
    chat_messages = [*user(THOUGHT), {"role": "assistant", "content": "It is blue",
                                      "reasoning_content": "I ponder the sky"}, *user("and the sea?")]
    r = http.post("/v1/chat/completions", json={
        "model": "mola-demo", "messages": chat_messages, "temperature": 0, "max_tokens": 1})
    assert count == r.json()["usage"]["prompt_tokens"]


# ---- auth and errors -----------------------------------------------------------------------


def test_auth_by_x_api_key_or_bearer(server):
    body = {"model": "upper", "max_tokens": 20, "messages": user("ok")}
    by_bearer = anthropic.Anthropic(base_url=server.url, auth_token=API, max_retries=0, timeout=60)
    assert by_bearer.messages.create(**body, extra_body=T0).content[0].text == "OK"
    for key in ("wrong-key", None):
        headers = {} if key is None else {"x-api-key": key}
        r = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 401
        assert ERROR.validate_python(r.json()).error.type == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong-key", max_retries=0).messages.create(**body)
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": API})  # the header opens every route
    assert r.status_code == 200 and r.json()["object"] == "list"
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong-key"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's envelope there


GOOD = {"model": "upper", "max_tokens": 20, "messages": user("ok")}


@pytest.mark.parametrize("body, status, kind, words", [
    (b'{"model": "upper", "max_tokens": 20,', 400, "invalid_request_error", "not valid JSON"),
    (b'[1, 2]', 400, "invalid_request_error", "JSON object"),
    ({k: v for k, v in GOOD.items() if k != "max_tokens"}, 400, "invalid_request_error", "'max_tokens'"),
    ({**GOOD, "max_tokens": "20"}, 400, "invalid_request_error", "'max_tokens'"),
    ({**GOOD, "messages": "ok"}, 400, "invalid_request_error", "'messages'"),
    ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ({**GOOD, "temperature": 1.5}, 400, "invalid_request_error", "'temperature'"),
    ({**GOOD, "model": "nope"}, 404, "not_found_error", "'nope' does not exist"),
    ({**GOOD, "top_k": 40}, 400, "invalid_request_error", "top_k 40 cannot be honoured"),
    ({**GOOD, "stop": ["x"]}, 400, "invalid_request_error", "stop_sequences"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "Unsupported image source type None"),
    ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400,
     "invalid_request_error", "does not take images"),
    ({**GOOD, "messages": [*user("hi"), {"role": "assistant", "content": "The answer is"}]}, 400,
     "invalid_request_error", "prefilled"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "server tools"),
    ({**GOOD, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400,
     "invalid_request_error", "'nope'"),
    ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 100}}, 400, "invalid_request_error", "1024"),
    ({**GOOD, "output_config": {"effort": "low"}}, 400, "invalid_request_error", "output_config.effort"),
])
def test_bad_requests_get_anthropics_envelope(server, body, status, kind, words):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = ERROR.validate_python(r.json())
    assert error.type == "error" and error.error.type == kind and words in error.error.message, r.text
    assert error.request_id == r.headers["x-request-id"]


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="nope", max_tokens=5, messages=user("ok"))
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(model="upper", max_tokens=5, messages=user("ok"), extra_body={"top_k": 3})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=user("ok"))


# ---- the pieces, without a server -----------------------------------------------------------


def test_a_conversation_becomes_chat_messages():
    body = CountTokensRequest(model="m", system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                              messages=[
        {"role": "user", "content": "q1"},
        {"role": "user", "content": [{"type": "text", "text": "q2", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
            {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "2"}], "is_error": True},
            {"type": "text", "text": "and?"}]},
    ])
    assert to_chat_messages(body) == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q1\nq2"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}}],
         "reasoning_content": "hmm", "thinking": "hmm"},
        {"role": "tool", "tool_call_id": "t1", "content": "1"},
        {"role": "tool", "tool_call_id": "t2", "content": "2"},
        {"role": "user", "content": "and?"},
    ]


def test_image_blocks_become_image_parts_in_order():
    """Images keep their place among the texts (adjacent texts joined as ever); a user turn
    after a user turn is combined; a tool_result still splits the turn."""
    from mola.frontend.images_in import ImageSource

    png = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = CountTokensRequest(model="m", messages=[
        {"role": "user", "content": "look:"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
            {"type": "image", "source": png},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}},
            {"type": "text", "text": "c"},
            {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
            {"type": "text", "text": "d"}]},
    ])
    first = ImageSource(param="messages[1].content[2].source", media_type="image/png", data="AAAA")
    second = ImageSource(param="messages[1].content[3].source.url", url="https://example.com/x.png")
    assert to_chat_messages(body) == [
        {"role": "user", "content": [{"type": "text", "text": "look:\na\nb"}, {"type": "image", "source": first},
                                     {"type": "image", "source": second}, {"type": "text", "text": "c"}]},
        {"role": "tool", "tool_call_id": "t1", "content": "1"},
        {"role": "user", "content": "d"},
    ]


def test_stop_reasons():
    assert stop_reason("stop", None, False) == ("end_turn", None)
    assert stop_reason("stop", "##", False) == ("stop_sequence", "##")
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    assert stop_reason(None, None, True) == ("tool_use", None)  # cut after the first call
    assert stop_reason("length", None, True) == ("max_tokens", None)


def test_the_builder_makes_thinking_text_and_tool_blocks_in_order():
    """Thinking comes only through the hook (convert.thinking_text); the
    builder already makes its blocks, each event one of the SDK's types."""
    b = MessageBuilder("m")
    events = b.start(usage(10, 0, 4))
    events += b.add("I think", "", [])
    events += b.add(" so", "  ", [])  # whitespace alone opens no text block
    events += b.add("", "", [{"id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": '{"x": 1}'}}])
    events += b.add("", "done", [])
    events += b.finish("end_turn", None, usage(10, 7, 4))
    for e in events:
        RAW_EVENT.validate_python(e)
    check_order(events)
    assert b.message["content"] == [{"type": "thinking", "thinking": "I think so", "signature": ""},
                                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                                    {"type": "text", "text": "done"}]
    assert b.message["usage"] == {"input_tokens": 6, "output_tokens": 7, "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 4}
    empty = MessageBuilder("m")
    events = empty.start(usage(3, 0, 0)) + empty.finish("end_turn", None, usage(3, 1, 0))
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    assert empty.message["content"] == []
