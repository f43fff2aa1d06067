"""The pieces of the Responses API without a server (mola/server/responses_api):
the LRU store, input items as chat messages, the event builder (every event
against its schema), and the request's translation to chat's shapes that the
constraint hook hands on."""

from __future__ import annotations

import pytest

from mola.errors import InvalidRequest, MolaError, ResponseNotFound
from mola.server.responses_api.events import ResponseBuilder
from mola.server.responses_api.items import normalize_input, normalize_item, to_messages
from mola.server.responses_api.objects import request_fields
from mola.server.responses_api.protocol import ResponsesRequest, constrain
from mola.server.responses_api.store import ResponseStore, StoredResponse

from helpers.schemas import validate_schema, validate_stream_event

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def entry(n: int) -> StoredResponse:
    return StoredResponse({"id": f"r{n}"}, ({"type": "message", "role": "user", "content": str(n)},))


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(capacity=2)
    store.put("r1", entry(1))
    store.put("r2", entry(2))
    assert store.get("r1").response == {"id": "r1"}  # r1 is now the most recent
    store.put("r3", entry(3))
    assert len(store) == 2 and store.get("r3").items[0]["content"] == "3"
    with pytest.raises(ResponseNotFound, match="r2' was evicted .* keeps the 2 most recently used") as e:
        store.get("r2")
    assert e.value.param == "previous_response_id"
    with pytest.raises(ResponseNotFound, match="No stored response has id 'r9'"):
        store.get("r9")
    store.delete("r1")
    with pytest.raises(ResponseNotFound):
        store.get("r1")


def test_a_store_of_size_zero_keeps_nothing():
    store = ResponseStore(capacity=0)
    store.put("r1", entry(1))
    assert len(store) == 0
    with pytest.raises(ValueError, match="-1"):
        ResponseStore(capacity=-1)


def test_the_store_forgets_evicted_ids_too_in_the_end():
    store = ResponseStore(capacity=1)
    for n in range(20):
        store.put(f"r{n}", entry(n))
    with pytest.raises(ResponseNotFound, match="No stored"):  # beyond EVICTED_MEMORY per slot
        store.get("r0")
    with pytest.raises(ResponseNotFound, match="evicted"):
        store.get("r18")


def test_items_become_chat_messages():
    items = normalize_input([
        {"role": "developer", "content": "d"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}', "id": "fc_1"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call_output", "call_id": "call_2", "output": "2"},
        {"type": "function_call", "call_id": "call_3", "name": "f", "arguments": "{}"},
    ])
    assert to_messages(items, "be kind") == [
        {"role": "system", "content": "be kind"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert normalize_input("hi") == [{"type": "message", "role": "user", "content": "hi"}]
    assert to_messages(normalize_input("hi"), None) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("item, param", [
    ({"type": "message", "role": "user", "content": 3}, "input[0].content"),
    ({"type": "message", "role": "user", "content": [{"type": "input_audio"}]}, "input[0].content[0]"),
    ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": 1}]},
     "input[0].content[0]"),
    ({"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}, "input[0].name"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": 1}}, "input[0].arguments"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
    ({"content": "no role, no type"}, "input[0].type"),
])
def test_bad_items_name_their_place(item, param):
    with pytest.raises(InvalidRequest) as e:
        normalize_input([item])
    assert e.value.param == param


def build(body: dict | None = None) -> ResponseBuilder:
    return ResponseBuilder(request_fields(ResponsesRequest(model="m", input="x", **(body or {}))))


def check(events: list[dict]) -> list[str]:
    for e in events:
        validate_stream_event(e)
    return [e["type"] for e in events]


def test_text_a_call_and_text_again_are_three_items_in_order():
    b = build({"tools": [{"type": "function", "name": "f", "parameters": None}]})
    events = b.start() + b.add("Sure", []) + b.add(". ", []) + b.add("", [CALL]) + b.add("Done", [])
    events += b.finish("tool_calls", 10, 7)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = check(events)
    assert kinds.count("response.output_item.added") == 3 and kinds.count("response.output_item.done") == 3
    assert kinds[-1] == "response.completed"
    final = events[-1]["response"]
    validate_schema("Response", final)
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "message"]
    texts = [i["content"][0]["text"] for i in final["output"] if i["type"] == "message"]
    assert texts == ["Sure. ", "Done"]
    assert final["output"][1]["call_id"] == "call_1" and final["output"][1]["arguments"] == '{"x": 1}'
    assert final["usage"]["total_tokens"] == 17 and final["status"] == "completed"
    assert events[2]["item"]["content"] == [] and events[3]["part"]["text"] == ""  # as they were then
    indexes = {e["output_index"] for e in events if e["type"] == "response.output_item.added"}
    assert indexes == {0, 1, 2}
    # every output item validates as input again (what previous_response_id replays)
    again = [normalize_item(i, "x")["type"] for i in final["output"]]
    assert again == ["message", "function_call", "message"]


def test_whitespace_before_a_call_opens_no_message():
    b = build()
    check(b.start() + b.add("\n", []) + b.add(" ", [CALL]) + b.finish("tool_calls", 1, 1))
    assert [i["type"] for i in b.response["output"]] == ["function_call"]


@pytest.mark.parametrize("text", ["", "  \n"])
def test_an_empty_or_blank_answer_is_still_one_message(text):
    b = build()
    check(b.start() + (b.add(text, []) if text else []) + b.finish("stop", 3, 1))
    assert [(i["type"], i["content"][0]["text"]) for i in b.response["output"]] == [("message", text)]


def test_length_is_incomplete_and_failure_is_failed():
    b = build({"max_output_tokens": 2})
    kinds = check(b.start() + b.add("ab", []) + b.finish("length", 3, 2))
    assert kinds[-1] == "response.incomplete"
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert b.response["output"][0]["status"] == "incomplete"
    validate_schema("Response", b.response)
    b = build()
    kinds = check(b.start() + b.add("ab", []) + b.fail(MolaError("the engine stopped"), 3, 1))
    assert kinds[-1] == "response.failed"
    assert b.response["error"] == {"code": "server_error", "message": "the engine stopped"}
    assert b.response["output"][0]["status"] == "incomplete"
    validate_schema("Response", b.response)


def test_the_hook_hands_on_chat_shapes():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    tools = [{"type": "function", "name": "f", "parameters": schema}]
    body = ResponsesRequest(model="m", input="x", tools=tools, tool_choice={"type": "function", "name": "f"},
                            text={"format": {"type": "json_schema", "name": "A", "schema": schema,
                                             "strict": True}}, parallel_tool_calls=False)
    assert constrain(body) == (
        {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}},
        {"type": "function", "function": {"name": "f"}})
    assert body.chat_tools() == [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    # one call at most is enforced only where calls are forced
    with pytest.raises(InvalidRequest) as e:
        constrain(ResponsesRequest(model="m", input="x", tools=tools, tool_choice="auto", parallel_tool_calls=False))
    assert e.value.param == "parallel_tool_calls"
    assert constrain(ResponsesRequest(model="m", input="x", tools=tools, tool_choice="auto",
                                      text={"format": {"type": "text"}})) == (None, "auto")
    constrain(ResponsesRequest(model="m", input="x", parallel_tool_calls=False))  # no tools: nothing to limit
