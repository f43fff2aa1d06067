"""Images in chat through the real app, in process (helpers/scripted.py): the
OpenAI and Anthropic dialects' image parts reach the pipeline, every bad
image is a 4xx in the dialect's envelope naming what is wrong (and costs no
tokenizer trip), the server stays healthy after each, a base that takes no
images says so naming the model, and decoding runs off the event loop.

The tiny text model stands in for a base that takes images (``takes_images``
set on its state): what these tests check happens before any model reads an
image (mola/frontend/images_in.py, prepare.with_images)."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest

from helpers.vision import crafted_png, data_url, image_bytes, require_pillow

require_pillow()

from helpers.scripted import client, tokenizer_model  # noqa: E402
from test_inprocess import Trips  # noqa: E402

from mola.frontend import prepare  # noqa: E402

PNG = image_bytes("PNG", (6, 4), color=(10, 200, 30))
TEXT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tokenizer_model(tiny_model)


def run(model, scenario, takes_images: bool = True, **settings):
    async def main():
        async with client(model, **settings) as c:
            c.state.takes_images = takes_images
            return await asyncio.wait_for(scenario(c), timeout=60)
    return asyncio.run(main())


def chat(*parts: dict, stream: bool = False) -> dict:
    return {"model": "tiny", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def image_url(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def messages(*blocks: dict, stream: bool = False) -> dict:
    return {"model": "tiny", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *blocks]}]}


def b64_block(raw: bytes | str, media_type: str = "image/png") -> dict:
    data = raw if isinstance(raw, str) else base64.b64encode(raw).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


# (body, words the error must hold, the field it must name)
BAD = {
    "malformed base64": (chat(image_url("data:image/png;base64,not*base64")), "not valid base64",
                         "messages[0].content[1].image_url.url"),
    "unsupported media type": (chat(image_url("data:image/tiff;base64,AAAA")), "'image/tiff'",
                               "messages[0].content[1].image_url.url"),
    "lying png header": (chat(image_url(data_url(crafted_png(100_000, 100_000)))), "--max-image-pixels",
                         "messages[0].content[1].image_url.url"),
    "truncated png": (chat(image_url(data_url(crafted_png(90, 90)))), "truncated or corrupt",
                      "messages[0].content[1].image_url.url"),
    "not an image": (chat(image_url(data_url(b"plain text, no image"))), "could not be read",
                     "messages[0].content[1].image_url.url"),
    "too many images": (chat(*[image_url(data_url(PNG))] * 3), "3 images; at most 2", "messages"),
    "remote url": (chat(image_url("https://example.com/cat.png")), "--allow-remote-images",
                   "messages[0].content[1].image_url.url"),
    "bad detail": (chat(image_url(data_url(PNG), detail="ultra")), "'ultra'",
                   "messages[0].content[1].image_url.detail"),
    "image in a system message": ({"model": "tiny", "messages": [
        {"role": "system", "content": [image_url(data_url(PNG))]}, *TEXT]}, "user messages",
        "messages[0].content[0]"),
    "over the byte bound": (chat(image_url(data_url(image_bytes("PNG", (64, 64), noise=True)))),
                            "--max-image-bytes", "messages[0].content[1].image_url.url"),
    "over the pixel bound": (chat(image_url(data_url(image_bytes("PNG", (100, 100))))), "--max-image-pixels",
                             "messages[0].content[1].image_url.url"),
}
ANTHROPIC_BAD = {
    "malformed base64": (messages(b64_block("%%%")), "not valid base64", "messages[0].content[1].source"),
    "unsupported media type": (messages(b64_block(PNG, "image/bmp")), "'image/bmp'",
                               "messages[0].content[1].source"),
    "lying png header": (messages(b64_block(crafted_png(9_000, 9_000))), "--max-image-pixels",
                         "messages[0].content[1].source"),
    "too many images": (messages(*[b64_block(PNG)] * 3), "3 images; at most 2", "messages"),
    "remote url": (messages({"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}),
                   "--allow-remote-images", "messages[0].content[1].source.url"),
    "unknown source": (messages({"type": "image", "source": {"type": "file", "file_id": "f"}}),
                       "'file'", "messages[0].content[1].source"),
    "image in a tool result": ({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [b64_block(PNG)]}]}]},
        "user messages only", "messages[0].content[0].content[0]"),
}
LIMITS = {"max_images_per_request": 2, "max_image_bytes": 4096, "max_image_pixels": 9_999}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_image_in_chat_is_a_400_naming_it_and_the_server_stays_healthy(model, case):
    body, words, param = BAD[case]

    async def scenario(c):
        trips = Trips(c.state)
        bad = await c.post("/v1/chat/completions", json=body)
        refused_trips = trips.count
        after = await c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": TEXT})
        return bad, refused_trips, after
    bad, refused_trips, after = run(model, scenario, **LIMITS)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert refused_trips == 0  # refused before the tokenizer
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("case", sorted(ANTHROPIC_BAD))
def test_a_bad_image_in_messages_is_a_400_in_anthropics_envelope(model, case):
    body, words, param = ANTHROPIC_BAD[case]

    async def scenario(c):
        bad = await c.post("/v1/messages", json=body)
        after = await c.post("/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": TEXT})
        return bad, after
    bad, after = run(model, scenario, **LIMITS)
    assert bad.status_code == 400, bad.text
    j = bad.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert words in j["error"]["message"], j
    assert after.status_code == 200 and after.json()["content"][0]["text"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(image_url(data_url(PNG)))),
    ("/v1/messages", messages(b64_block(PNG))),
])
def test_a_base_that_takes_no_images_names_the_model(model, path, body):
    async def scenario(c):
        trips = Trips(c.state)
        r = await c.post(path, json=body)
        return r, trips.count, await c.post(path, json={"model": "tiny", "max_tokens": 3, "messages": TEXT})
    r, trips, after = run(model, scenario, takes_images=False)
    assert r.status_code == 400 and "The model 'tiny' does not take images" in r.text
    assert trips == 0 and after.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_good_image_is_served_in_both_dialects(model, stream):
    async def scenario(c):
        a = await c.post("/v1/chat/completions", json=chat(image_url(data_url(PNG), "low"), stream=stream))
        b = await c.post("/v1/messages", json=messages(b64_block(PNG), stream=stream))
        return a, b, len(c.engine.submitted)
    a, b, submitted = run(model, scenario)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert submitted == 2


def test_images_decode_off_the_event_loop(model, monkeypatch):
    """A request whose image is decoding does not hold up another: the decode
    waits until a text request has been served, which could not happen if
    it ran on the event loop."""
    released = threading.Event()
    decode = prepare.decode_messages

    def slow_decode(messages, limits):
        assert released.wait(30), "the text request was not served while an image was decoding"
        return decode(messages, limits)
    monkeypatch.setattr(prepare, "decode_messages", slow_decode)

    async def scenario(c):
        image = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat(image_url(data_url(PNG)))))
        text = await c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": TEXT})
        assert not image.done()
        released.set()
        return text, await image
    text, image = run(model, scenario)
    assert text.status_code == 200 and image.status_code == 200


@pytest.mark.parametrize("takes_images", [False, True])
def test_count_tokens_decodes_images_as_messages_does(model, takes_images):
    """/v1/messages/count_tokens takes the same path: a text-only base names the model, a bad image
    is the same 400, a good one is counted as /v1/messages renders it."""
    async def scenario(c):
        path = "/v1/messages/count_tokens"
        good = await c.post(path, json={"model": "tiny", "messages": messages(b64_block(PNG))["messages"]})
        bad = await c.post(path, json={"model": "tiny", "messages": messages(b64_block("%%%"))["messages"]})
        served = await c.post("/v1/messages", json=messages(b64_block(PNG)))
        return good, bad, served, c.engine.submitted
    good, bad, served, submitted = run(model, scenario, takes_images=takes_images)
    if not takes_images:
        assert good.status_code == bad.status_code == 400 and "The model 'tiny' does not take images" in good.text
        return
    assert bad.status_code == 400 and "not valid base64" in bad.text
    assert served.status_code == 200 and good.json() == {"input_tokens": len(submitted[0].prompt)}


def test_openai_image_parts_become_image_parts_in_order():
    """A user message with images keeps its parts in order (the URL may be a bare string); one
    without stays one string, its texts joined as before; other roles' text parts too."""
    from mola.frontend.images_in import ImageSource
    from mola.server.dialects.chat import message_dicts
    from mola.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, image_url("data:image/png;base64,AAAA", "high"),
                                     {"type": "image_url", "image_url": "data:image/gif;base64,BBBB"},
                                     {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}])
    assert message_dicts(body.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "image", "source": ImageSource("messages[1].content[1].image_url.url",
                                                    url="data:image/png;base64,AAAA")},
            {"type": "image", "source": ImageSource("messages[1].content[2].image_url.url",
                                                    url="data:image/gif;base64,BBBB")},
            {"type": "text", "text": "b"}]},
        {"role": "user", "content": "cd"}]
