"""What the ingress answers for a replica that failed a request
(mola/ray/failures.py): before the answer, a 503 with Retry-After in the
route's error envelope (OpenAI's; Anthropic's on /v1/messages); part-way
through a stream, the event the dialect's own streams end a failure with,
checked against the official schemas where mola has them; a Responses stream
ends with the ``response.failed`` mola's own ResponseBuilder makes for the
same events, read back from the wire in chunks cut anywhere."""

from __future__ import annotations

import json

import pytest

from helpers.schemas import sse_events, typed_events, validate_schema, validate_stream_event
from mola.errors import EngineUnavailable
from mola.ray.failures import StreamTail, before_answer, mid_stream, replica_lost
from mola.server.responses_api.events import ResponseBuilder
from mola.server.responses_api.objects import request_fields
from mola.server.responses_api.protocol import ResponsesRequest
from mola.server.streaming import sse_event

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def test_before_the_answer_a_503_in_the_routes_envelope():
    exc = replica_lost("ActorDiedError")
    status, headers, body = before_answer("/v1/chat/completions", exc)
    assert status == 503 and headers["retry-after"] == "5"
    error = json.loads(body)["error"]
    assert error["code"] == "engine_unavailable" and "ActorDiedError" in error["message"]
    status, _, body = before_answer("/v1/messages", exc)
    anthropic = json.loads(body)
    assert status == 503 and anthropic["type"] == "error"
    assert anthropic["error"]["type"] == "overloaded_error" and "ActorDiedError" in anthropic["error"]["message"]


def test_mid_stream_the_dialects_error_event():
    exc = replica_lost("ActorDiedError")
    (chat,) = sse_events(mid_stream("/v1/chat/completions", exc).decode())
    assert chat["error"]["code"] == "engine_unavailable" and chat["error"]["type"] == "service_unavailable"
    head, data = mid_stream("/v1/messages", exc).decode().strip().split("\n")
    assert head == "event: error" and json.loads(data[len("data: "):])["error"]["type"] == "overloaded_error"
    head, data = mid_stream("/v1/responses", exc).decode().strip().split("\n")
    event = json.loads(data[len("data: "):])
    assert head == "event: error" and event["code"] == "engine_unavailable"
    validate_schema("ResponseErrorEvent", {**event, "sequence_number": 0})


@pytest.mark.parametrize("chunk", [1, 7, 10 ** 6])
def test_a_cut_responses_stream_ends_with_the_response_failed_mola_itself_makes(chunk):
    b = ResponseBuilder(request_fields(ResponsesRequest(
        model="m", input="x", tools=[{"type": "function", "name": "f", "parameters": None}])))
    events = b.start() + b.add("Sure", []) + b.add(", and", []) + b.add("", [CALL]) + b.add("more", [])
    wire = "".join(sse_event(e) for e in events).encode()
    tail = StreamTail("/v1/responses")
    for i in range(0, len(wire), chunk):  # the chunks as the replica's app happened to send them
        tail.see(wire[i:i + chunk])
    (got,) = typed_events(tail.end(replica_lost("ActorDiedError")).decode())
    validate_stream_event(got)
    (want,) = b.fail(EngineUnavailable("lost"), 0, 0)  # what mola's own engine failure ends it with
    assert got["type"] == want["type"] == "response.failed"
    assert got["sequence_number"] == want["sequence_number"] == len(events)
    for key in ("id", "status", "output", "model", "tools"):
        assert got["response"][key] == want["response"][key], key
    assert [i["status"] for i in got["response"]["output"]] == ["completed", "completed", "incomplete"]
    assert got["response"]["output"][2]["content"][0]["text"] == "more"
    assert "ActorDiedError" in got["response"]["error"]["message"]


def test_a_responses_stream_cut_before_its_response_began_ends_with_the_error_event():
    tail = StreamTail("/v1/responses")
    tail.see(b": a comment, no event yet\n\n")
    exc = replica_lost("ActorDiedError")
    assert tail.end(exc) == mid_stream("/v1/responses", exc)
    chat = StreamTail("/v1/chat/completions")
    chat.see(b'data: {"response": {"output": []}}\n\n')  # read only on the Responses route
    assert chat.end(exc) == mid_stream("/v1/chat/completions", exc)
