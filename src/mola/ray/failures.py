"""What the ingress answers when a replica fails a request it had taken (the
replica's process died, or Ray could not reach it): mola's own error shapes,
per dialect, so a client sees what a single `mola serve` whose engine died
would have sent. No Ray here.

Before any byte of the answer: a 503 with the dialect's error envelope and
Retry-After. Part-way through a stream (the status line is gone already):
the stream's error event, as the dialect's streams end on an engine failure
(server/dialects/chat.py, completions.py, messages.py), then the end. A
Responses stream ends as mola's own failed response ends
(responses_api/events.py): ``response.failed``, its response the one the stream
had built so far (:class:`StreamTail` reads it from the events passing by).
"""

from __future__ import annotations

import json

from ..errors import EngineUnavailable
from ..server.anthropic.errors import is_anthropic_path, stream_error
from ..server.errors import error_payload, status_of
from ..server.anthropic.errors import envelope
from ..server.streaming import sse, sse_event

RESPONSES = "/v1/responses"


def replica_lost(detail: str) -> EngineUnavailable:
    return EngineUnavailable(f"The replica serving this request failed ({detail}); Ray restarts it, "
                             "and a retry is served by a live replica.")


def before_answer(path: str, exc: EngineUnavailable) -> tuple[int, dict, bytes]:
    """(status, headers, body) of the error response on ``path``."""
    status, _, code = status_of(exc)
    payload = envelope(status, exc.message, code) if is_anthropic_path(path) else error_payload(exc)
    headers = {"content-type": "application/json", "retry-after": "5"}
    return status, headers, json.dumps(payload).encode()


def mid_stream(path: str, exc: EngineUnavailable) -> bytes:
    """The event that ends a stream on ``path`` that the failure cut."""
    if is_anthropic_path(path):
        return sse_event(stream_error(exc)).encode()
    if path.startswith(RESPONSES):  # the Responses API's own `error` event
        _, _, code = status_of(exc)
        return sse_event({"type": "error", "code": code, "message": exc.message, "param": None}).encode()
    return sse(error_payload(exc)).encode()


class StreamTail:
    """The end of one stream through the ingress, should its replica be lost:
    for a Responses stream, what it has said so far (the response of
    ``response.created``, its output items, parts and deltas, the last
    ``sequence_number``), read from the events as they pass."""

    def __init__(self, path: str):
        self.path = path
        self.responses = path.startswith(RESPONSES)
        self.response: dict | None = None
        self.seq = -1
        self._buffer = b""

    def see(self, chunk: bytes) -> None:
        if not self.responses:
            return
        *events, self._buffer = (self._buffer + chunk).split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    try:
                        self._take(json.loads(line[len(b"data: "):]))
                    except (ValueError, LookupError, TypeError, AttributeError):
                        pass  # not an event this reads: the stream goes on as it was

    def _take(self, e: dict) -> None:
        self.seq = e.get("sequence_number", self.seq)
        kind = e.get("type", "")
        if isinstance(e.get("response"), dict):
            self.response = e["response"]
        elif self.response is None:
            return
        output = self.response["output"]
        if kind in ("response.output_item.added", "response.output_item.done"):
            output[e["output_index"]:e["output_index"] + 1] = [e["item"]]
        elif kind in ("response.content_part.added", "response.content_part.done"):
            parts = output[e["output_index"]]["content"]
            parts[e["content_index"]:e["content_index"] + 1] = [e["part"]]
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            output[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            output[e["output_index"]]["arguments"] += e["delta"]

    def end(self, exc: EngineUnavailable) -> bytes:
        """The event that ends this stream, cut by ``exc``."""
        if not self.responses or self.response is None:
            return mid_stream(self.path, exc)
        output = [{**item, "status": "incomplete"} if item.get("status") == "in_progress" else item
                  for item in self.response["output"]]
        response = {**self.response, "status": "failed", "output": output,
                    "error": {"code": "server_error", "message": exc.message}}
        return sse_event({"type": "response.failed", "sequence_number": self.seq + 1, "response": response}).encode()
