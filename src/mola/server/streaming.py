"""Server-sent events, as OpenAI streams them: `data: <json>` lines, each
followed by a blank line, and a final `data: [DONE]` (chat, completions); or
typed events, `event: <type>` before each `data:` line and no [DONE]
(the Responses API)."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(payload: dict) -> str:
    """A typed event: ``payload["type"]`` names it."""
    return f"event: {payload['type']}\n{sse(payload)}"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def event_stream(events: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    """An SSE response of ``events``; ``on_close`` runs when it ends, however
    it ends (client gone included)."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(on_close),
    )
