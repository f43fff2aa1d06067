"""What the ingress answers when a replica fails a request it had taken (the
replica's process died, or Ray could not reach it): mola's own error shapes,
per dialect, so a client sees what a single `mola serve` whose engine died
would have sent. No Ray here.

Before any byte of the answer: a 503 with the dialect's error envelope and
Retry-After. Part-way through a stream (the status line is gone already):
the stream's error event, as the dialect's streams end on an engine failure
(server/dialects/chat.py, completions.py, messages.py), then the end.
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
