"""--max-request-bytes (mola/server/middleware.py BodyLimitMiddleware): a
413 in OpenAI's envelope before the body is read whole, with or without a
Content-Length, through the app in process over a scripted engine (the
middleware is the subject: ASGI messages, as uvicorn hands them over)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from helpers.schemas import validate_schema
from helpers.scripted import InProcessServer, tokenizer_model

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model):
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", max_request_bytes=LIMIT)
    yield handle
    handle.stop()


def body_of(size: int) -> bytes:
    """A chat request of exactly ``size`` bytes (JSON whitespace pads it)."""
    raw = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert len(raw) <= size
    return (raw[:-1] + " " * (size - len(raw)) + "}").encode()


async def chunks(data: bytes, size: int = 8192):
    """``data`` as a chunked body: one ASGI message a chunk, no Content-Length."""
    for i in range(0, len(data), size):
        yield data[i:i + size]


def post_async(server, content, headers=None) -> httpx.Response:
    """POST a body that the app reads as it arrives (an async stream of chunks)."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://mola") as c:
            # A server that waited for a body that never ends would never answer: wait_for fails the test.
            return await asyncio.wait_for(c.post("/v1/chat/completions", content=content, headers={
                "Content-Type": "application/json", **(headers or {})}), 30)
    return server.run(main())


def assert_413(r):
    assert r.status_code == 413, r.text
    validate_schema("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    assert str(LIMIT) in error["message"]


def test_content_length_just_under_at_and_over(server):
    headers = {"Content-Type": "application/json"}
    with server.client() as c:
        for size in (LIMIT - 1, LIMIT):
            r = c.post("/v1/chat/completions", content=body_of(size), headers=headers)
            assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", content=body_of(LIMIT + 1), headers=headers)
    assert_413(r)
    assert str(LIMIT + 1) in r.json()["error"]["message"]


def test_chunked_bodies_are_counted_and_cut_off(server):
    r = post_async(server, chunks(body_of(LIMIT)))
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 200, r.text
    assert_413(post_async(server, chunks(body_of(LIMIT + 1))))


async def never():
    """A body that never comes."""
    await asyncio.Event().wait()
    yield b""


async def endless(chunk: bytes = b" " * 0x2000):
    while True:
        yield chunk


def test_an_announced_body_over_the_limit_is_refused_unread(server):
    """A client that announces 1 GB and sends none of it gets its 413 at once:
    the app did not wait for (or read) the body. No clock needed: the body
    never comes, so an app that waited for it would never answer."""
    r = post_async(server, never(), {"Content-Length": "1000000000"})
    assert r.headers["connection"] == "close"
    assert_413(r)


def test_a_chunked_stream_is_cut_off_at_the_limit(server):
    """A chunked body that never ends is answered once it passes the limit,
    not read to its end."""
    assert_413(post_async(server, endless()))


def test_the_server_is_fine_afterwards(server):
    with server.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", content=body_of(1000), headers={"Content-Type": "application/json"})
    assert r.status_code == 200
