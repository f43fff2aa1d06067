"""Errors on Anthropic's routes in Anthropic's envelope:

    {"type": "error", "error": {"type": "invalid_request_error", "message": ...}, "request_id": ...}

Every error mola answers is made in OpenAI's envelope first (server/errors.py,
the middleware); :class:`AnthropicErrorsMiddleware` rewrites the ones that
leave /v1/messages, keeping the status code and headers, so a bad body, an
unknown model, a missing key or a body over the limit read as Anthropic's
SDK expects on those routes and as OpenAI's everywhere else.
"""

from __future__ import annotations

import json

from ...errors import MolaError
from ..errors import status_of

PREFIX = "/v1/messages"
# HTTP status -> Anthropic's error type (docs: "Errors", HTTP errors).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
         403: "permission_error", 404: "not_found_error", 413: "request_too_large",
         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
         529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(status: int, code: str | None = None) -> str:
    if code == "request_timeout":  # waited past --request-timeout (a 503)
        return "timeout_error"
    return TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def envelope(status: int, message: str, code: str | None = None, request_id: str | None = None) -> dict:
    body = {"type": "error", "error": {"type": error_type(status, code), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def stream_error(exc: MolaError) -> dict:
    """The ``error`` event of a stream that fails part-way."""
    status, _, code = status_of(exc)
    return envelope(status, exc.message, code)


def rewrite(status: int, body: bytes, request_id: str | None) -> bytes | None:
    """OpenAI's envelope in ``body`` as Anthropic's, or None when it is not one."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    return json.dumps(envelope(status, error["message"], error.get("code"), request_id)).encode()


class AnthropicErrorsMiddleware:
    """Rewrites JSON error responses (status >= 400) on Anthropic's routes;
    passes everything else through untouched (streams included)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            return await self.app(scope, receive, send)
        held: dict = {}
        chunks: list[bytes] = []

        async def send_rewritten(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"] = message
                return
            if "start" not in held or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start, body = held.pop("start"), b"".join(chunks)
            request_id = scope.get("state", {}).get("request_id")
            new = rewrite(start["status"], body, request_id)
            if new is not None:
                body = new
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                start = {**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
            await send(start)
            await send({"type": "http.response.body", "body": body})

        return await self.app(scope, receive, send_rewritten)
