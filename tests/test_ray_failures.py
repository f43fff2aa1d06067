"""What the ingress answers for a replica that failed a request
(mola/ray/failures.py): before the answer, a 503 with Retry-After in the
route's error envelope (OpenAI's; Anthropic's on /v1/messages); part-way
through a stream, the event the dialect's own streams end a failure with,
checked against the official schemas where mola has them."""

from __future__ import annotations

import json

from helpers.schemas import sse_events, validate_schema
from mola.ray.failures import before_answer, mid_stream, replica_lost


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
