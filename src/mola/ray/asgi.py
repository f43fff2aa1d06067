"""One raw HTTP request through mola's own ASGI app (create_app), in process,
its response given back piece by piece: the replica's side of the ingress's
forwarding. No Ray here, so the fast tier tests it.

A request crosses from the ingress as a :class:`RawRequest`; the answer comes
back as a :class:`Head` (status and headers) followed by body chunks, each as
the app sent it, so a stream stays a stream (httpx's ASGITransport would
gather the whole body first).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass(frozen=True)
class RawRequest:
    """What the ingress read of an HTTP request (plain data: it crosses processes)."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""


@dataclass(frozen=True)
class Head:
    """The start of a response."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


def scope_of(req: RawRequest) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
        "method": req.method, "path": req.path, "raw_path": req.path.encode(), "root_path": "",
        "query_string": req.query, "headers": list(req.headers),
        "client": ("127.0.0.1", 0), "server": ("mola-replica", 80),
    }


async def call(app, req: RawRequest) -> AsyncIterator[Head | bytes]:
    """``app``'s answer to ``req``: its Head, then its body chunks. Leaving
    early (the client went away) tells the app the client disconnected, which
    frees the request's batch row."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body = [req.body]

    async def receive():
        if body:
            return {"type": "http.request", "body": body.pop(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    task = asyncio.ensure_future(app(scope_of(req), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield Head(message["status"], tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # raises what the app raised (it answers errors itself; a bug gets here)
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=30)
