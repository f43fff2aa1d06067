"""One raw request through mola's app, answered piece by piece (mola/ray/asgi.py):
the same status, headers and body as httpx's ASGI transport gets from the same
app (the reference), a stream arriving as several pieces, and a caller that
leaves early freeing the request's row. In process, scripted engine, no Ray."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.schemas import sse_events
from helpers.scripted import ScriptedEngine, client, tokenizer_model
from mola.ray.asgi import Head, RawRequest, call

MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tokenizer_model(tiny_model)


def raw(body: dict | bytes, path="/v1/chat/completions") -> RawRequest:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return RawRequest("POST", path, b"", ((b"content-type", b"application/json"),), content)


async def gather(app, req: RawRequest) -> tuple[Head, list[bytes]]:
    pieces = [p async for p in call(app, req)]
    assert isinstance(pieces[0], Head) and all(isinstance(p, bytes) for p in pieces[1:])
    return pieces[0], pieces[1:]


@pytest.mark.parametrize("body", [
    {"model": "tiny", "messages": MSG, "max_tokens": 4},
    {"model": "nope", "messages": MSG, "max_tokens": 4},  # a 404 in the error envelope
    b"{not json",  # a 400
])
def test_answers_as_the_app_answers_httpx(model, body):
    async def go():
        async with client(model) as c:
            head, chunks = await gather(c.app, raw(body))
            ref = await c.post("/v1/chat/completions", content=raw(body).body,
                               headers={"content-type": "application/json"})
            return head, b"".join(chunks), ref

    head, content, ref = asyncio.run(go())
    assert head.status == ref.status_code
    mine, theirs = json.loads(content), ref.json()
    for answer in (mine, theirs):  # ids and times differ between two answers
        answer.pop("id", None), answer.pop("created", None)
    assert mine == theirs
    assert dict(head.headers)[b"content-type"] == ref.headers["content-type"].encode()


def test_a_stream_comes_back_in_pieces_and_ends_with_done(model):
    async def go():
        async with client(model) as c:
            return await gather(c.app, raw({"model": "tiny", "messages": MSG, "max_tokens": 5, "stream": True,
                                            "ignore_eos": True}))

    head, chunks = asyncio.run(go())
    assert head.status == 200 and dict(head.headers)[b"content-type"].startswith(b"text/event-stream")
    events = sse_events(b"".join(chunks).decode())
    assert events[-1] == "[DONE]" and len(chunks) >= 5  # a piece per event, not one body at the end


def test_leaving_early_frees_the_row(model):
    """The caller stops reading after the head: the app hears the client
    went away, and the engine's sequence is aborted."""
    engine = ScriptedEngine()
    engine.script = lambda seq: [7] * 1000

    async def go():
        async with client(model, engine) as c:
            pieces = call(c.app, raw({"model": "tiny", "messages": MSG, "max_tokens": 1000, "stream": True}))
            assert isinstance(await pieces.__anext__(), Head)
            await pieces.aclose()
            while engine.aborted == 0 and engine.snapshot.num_running:
                await asyncio.sleep(0)
            return engine.aborted

    assert asyncio.run(asyncio.wait_for(go(), timeout=60)) == 1
