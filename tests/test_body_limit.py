"""--max-request-bytes (mola/server/middleware.py BodyLimitMiddleware): a
413 in OpenAI's envelope before the body is read whole, with or without a
Content-Length, through a real server on 127.0.0.1."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from helpers.schemas import validate_schema
from helpers.servers import start_server

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model):
    handle = start_server(model=str(tiny_model), served_model_name="tiny", max_request_bytes=LIMIT)
    yield handle
    handle.stop()


def body_of(size: int) -> bytes:
    """A chat request of exactly ``size`` bytes (JSON whitespace pads it)."""
    raw = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert len(raw) <= size
    return (raw[:-1] + " " * (size - len(raw)) + "}").encode()


def chunks(data: bytes, size: int = 8192):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def assert_413(r):
    assert r.status_code == 413, r.text
    validate_schema("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    assert str(LIMIT) in error["message"]


def test_content_length_just_under_at_and_over(server):
    headers = {"Content-Type": "application/json"}
    for size in (LIMIT - 1, LIMIT):
        r = httpx.post(server.url + "/v1/chat/completions", content=body_of(size), headers=headers)
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/chat/completions", content=body_of(LIMIT + 1), headers=headers)
    assert_413(r)
    assert str(LIMIT + 1) in r.json()["error"]["message"]


def test_chunked_bodies_are_counted_and_cut_off(server):
    headers = {"Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(body_of(LIMIT)), headers=headers)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(body_of(LIMIT + 1)), headers=headers)
    assert_413(r)


def raw_request(server, head: bytes, body: bytes = b"") -> bytes:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        out = b""
        while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < 10:
            data = s.recv(65536)
            if not data:
                break
            out += data
    return out


def test_an_announced_body_over_the_limit_is_refused_unread(server):
    """A client that announces 1 GB and sends none of it gets its 413 at once:
    the server did not wait for (or read) the body. No clock needed: the
    client sends nothing after the head, so a server that waited for the body
    would never answer (and the socket's timeout would fail the test)."""
    out = raw_request(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert b"request_too_large" in payload


def test_a_chunked_stream_is_cut_off_at_the_limit(server):
    """A chunked body that never ends is answered once it passes the limit,
    not read to its end."""
    chunk = b"2000\r\n" + b" " * 0x2000 + b"\r\n"  # 8 KiB chunks, no terminating chunk
    out = raw_request(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
                      chunk * (LIMIT // 0x2000 + 1))
    assert out.startswith(b"HTTP/1.1 413") and b"request_too_large" in out


def test_the_server_is_fine_afterwards(server):
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", content=body_of(1000),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200
