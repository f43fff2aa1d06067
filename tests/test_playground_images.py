"""The playground's image fields (mola/server/ui/image.js) in a real browser:
an image picked from a file or pasted is sent by every column as an OpenAI
``image_url`` part (a data: URL of the very bytes), and each column's answer
equals the same request over the HTTP API; in the chat view, an image goes
with the next message and stays in the conversation after it.

The echo demo stands in for a base that takes images: its state says it
does (``takes_images``), so /v1/models gives its card ``input_modalities``
``["text", "image"]``, as a vision-language base's card says.
What the model makes of the image is the vision tests' business; here the
page's request and the side-by-side answers are checked. Skipped without
Chromium, as tests/test_playground.py is."""

from __future__ import annotations

import base64

import httpx
import pytest


from helpers.vision import image_bytes, require_pillow
from test_playground import (ADMIN_KEY, API_KEY, AUTH, BASE, MESSAGE, browser, columns, echo_server,  # noqa: F401
                             enter_keys, expect, open_page)

pytestmark = pytest.mark.slow  # the browser: CI's second tier, as test_playground.py
require_pillow()

PNG = image_bytes("PNG", (8, 6), color=(200, 40, 90))
MODELS = [BASE, "upper", "title"]


@pytest.fixture(scope="module")
def server(echo_demo):
    """The echo demo with upper and title, taking images."""
    handle = echo_server(echo_demo)
    handle.state.takes_images = True
    yield handle
    handle.stop()


def with_image_base(page, server) -> list[dict]:
    """The keys entered again (the page reads the models anew, the base's card
    taking images); returns the chat bodies the page sends."""
    card = next(c for c in httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"] if c["id"] == BASE)
    assert card["input_modalities"] == ["text", "image"]
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    enter_keys(page, API_KEY, ADMIN_KEY)
    expect(page.locator("#compare-image-field")).to_be_visible()
    return bodies


def ask(url: str, model: str, content) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 128}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def sent_image(body: dict) -> bytes:
    """The image bytes a chat body's user message carries (its one image_url part)."""
    text, image = body["messages"][-1]["content"]
    assert text == {"type": "text", "text": MESSAGE} and image["type"] == "image_url"
    head, data = image["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64"
    return base64.b64decode(data)


def test_the_image_field_is_hidden_when_no_base_takes_images(open_page, server):
    server.state.takes_images = False  # a text-only base: its card says ["text"]
    try:
        page = open_page()
        expect(page.locator("#model-ids option")).to_have_count(3)  # the models are read
        expect(page.locator("#compare-image-field")).to_be_hidden()
    finally:
        server.state.takes_images = True


def test_a_picked_image_goes_to_every_column_side_by_side(open_page, server):
    page = open_page()
    bodies = with_image_base(page, server)
    cols = columns(page, MODELS)
    page.get_by_label("Image file").set_input_files({"name": "dot.png", "mimeType": "image/png", "buffer": PNG})
    expect(page.locator("#compare-image-preview")).to_be_visible()
    expect(page.locator("#compare-image-status")).to_contain_text(f"dot.png (image/png, {len(PNG)} bytes)")
    page.get_by_role("button", name="Send to all columns").click()
    for i in range(len(MODELS)):
        expect(cols.nth(i)).to_have_attribute("aria-busy", "false")
    sent = [b for b in bodies if b]
    assert sorted(b.get("model") for b in sent) == sorted(MODELS) and all(sent_image(b) == PNG for b in sent)
    content = sent[0]["messages"][-1]["content"]
    expected = [ask(server.url, model, content) for model in MODELS]
    assert len(set(expected)) == 3  # the base and each adapter answer differently
    for i, answer in enumerate(expected):
        expect(cols.nth(i).locator(".answer")).to_have_text(answer)
        assert "error" not in (cols.nth(i).locator(".answer").get_attribute("class") or "")


def test_a_pasted_image_is_attached_and_removing_it_sends_text_only(open_page, server):
    page = open_page()
    bodies = with_image_base(page, server)
    columns(page, [BASE, "upper"])
    page.get_by_label("User message").focus()
    page.evaluate("""bytes => {
        const file = new File([new Uint8Array(bytes)], "", {type: "image/png"});
        const data = new DataTransfer();
        data.items.add(file);
        document.querySelector("#compare-user").dispatchEvent(
            new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true}));
    }""", list(PNG))
    expect(page.locator("#compare-image-status")).to_contain_text("a pasted image")
    page.get_by_role("button", name="Send to all columns").click()
    expect(page.locator(".column").nth(1)).to_have_attribute("aria-busy", "false")
    with_images = [b for b in bodies if b]
    assert len(with_images) == 2 and all(sent_image(b) == PNG for b in with_images)
    page.get_by_role("button", name="Remove image").click()
    expect(page.locator("#compare-image-preview")).to_be_hidden()
    bodies.clear()
    page.get_by_role("button", name="Send to all columns").click()
    expect(page.locator(".column").nth(1)).to_have_attribute("aria-busy", "false")
    assert [b["messages"][-1]["content"] for b in bodies if b] == [MESSAGE, MESSAGE]


def test_chat_sends_an_image_with_the_next_message_and_keeps_it_in_the_conversation(open_page, server):
    page = open_page()
    bodies = with_image_base(page, server)
    page.get_by_role("button", name="Chat").click()
    expect(page.locator("#chat-image-field")).to_be_visible()
    page.get_by_label("Image for the next message").set_input_files(
        {"name": "dot.png", "mimeType": "image/png", "buffer": PNG})
    expect(page.locator("#chat-image-status")).to_contain_text(f"dot.png (image/png, {len(PNG)} bytes)")
    box, log = page.locator("#chat-input"), page.locator("#chat-log li")
    box.fill(MESSAGE)
    box.press("Enter")
    expect(log.nth(0).locator("img")).to_be_visible()  # the image shown with the message it went with
    first = [b for b in bodies if b]
    assert len(first) == 1 and sent_image(first[0]) == PNG
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": BASE, "messages": first[0]["messages"], "temperature": 0, "max_tokens": 256})
    expect(log.nth(1).locator(".text")).to_have_text(r.json()["choices"][0]["message"]["content"])
    expect(page.locator("#chat-image-preview")).to_be_hidden()  # it went with that message alone
    bodies.clear()
    box.fill("and the next turn")
    box.press("Enter")
    expect(log.nth(3).locator(".text")).not_to_have_text("")
    second = [b for b in bodies if b]
    assert len(second) == 1
    turns = second[0]["messages"]
    assert turns[0] == first[0]["messages"][-1]  # the first message, its image and all
    assert turns[-1] == {"role": "user", "content": "and the next turn"}
