"""Server-sent events, as OpenAI streams them: `data: <json>` lines, each
followed by a blank line, and a final `data: [DONE]` (chat, completions); or
typed events, `event: <type>` before each `data:` line and no [DONE]
(the Responses API)."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
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


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(coro: Awaitable, request: Request):
    """Await ``coro``; if the client disconnects first, cancel it (which frees
    its batch rows) and return None."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        watch.cancel()
    return work.result() if not work.cancelled() else None


async def reply(request: Request, stream: bool, events: Callable[[], AsyncIterator[str]],
                complete: Callable[[], Awaitable[dict]], on_close: Callable[[], object]):
    """The response to a request: ``events()`` as SSE when it streams, else
    ``complete()``'s body as JSON (nothing when the client left first)."""
    if stream:
        return event_stream(events(), on_close)
    result = await run_until_disconnect(complete(), request)
    return JSONResponse(result) if result is not None else None
