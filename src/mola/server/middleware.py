"""ASGI middleware: access control, request ids with one log line per
request, HTTP metrics and the request body limit. Pure ASGI (no
BaseHTTPMiddleware), so streaming responses pass through untouched.

Access: with an API key, every /v1 route needs ``Authorization: Bearer KEY``
or ``x-api-key: KEY`` (Anthropic's header) (401 in OpenAI's envelope
otherwise, Anthropic's on /v1/messages); with an admin key, the routes that load
and unload adapters need that key. /health and /metrics stay open unless
metrics are protected (then they need the API key). Keys are compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid

log = logging.getLogger("mola.access")

# vLLM's routes that need the API key like every /v1 route.
API_ROUTES_OUTSIDE_V1 = {"/tokenize", "/detokenize"}
ADMIN_ROUTES = {
    ("POST", "/v1/adapters"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
}


def is_admin_route(method: str, path: str) -> bool:
    return (method, path) in ADMIN_ROUTES or (method == "DELETE" and path.startswith("/v1/adapters/")) or (
        method == "POST" and path.startswith("/v1/models/") and path.endswith(("/load", "/unload"))) or (
        is_push(method, path))


def is_push(method: str, path: str) -> bool:
    """PUT /v1/adapters/{name}/weights: an adapter's weights pushed in the body."""
    return method == "PUT" and path.startswith("/v1/adapters/") and path.endswith("/weights")


def _given_keys(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The keys a request presents: ``Authorization: Bearer KEY`` and ``x-api-key: KEY``."""
    keys = []
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            text = value.decode("latin-1").strip()
            if text[:7].lower() == "bearer ":
                keys.append(text[7:].strip())
        elif name == b"x-api-key":
            keys.append(value.decode("latin-1").strip())
    return keys


def _matches(given: list[str], key: str) -> bool:
    return any([hmac.compare_digest(k.encode(), key.encode()) for k in given])


async def _send_error(send, status: int, message: str, type_: str, code: str, headers=()) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    def __init__(self, app, api_key: str | None, admin_key: str | None, protect_metrics: bool):
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key
        self.protect_metrics = protect_metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        given = _given_keys(scope.get("headers", []))
        if self.admin_key and is_admin_route(method, path):
            needed = self.admin_key
        elif path.startswith("/v1") or path in API_ROUTES_OUTSIDE_V1 or (
                self.protect_metrics and path in ("/metrics", "/health")):
            needed = self.api_key
        else:
            needed = None
        if needed is not None and not _matches(given, needed):
            which = "an admin key" if needed is self.admin_key and needed != self.api_key else "an API key"
            reason = "is missing" if not given else "is not valid"
            return await _send_error(
                send, 401, f"This route needs {which} (Authorization: Bearer ... or x-api-key: ...); "
                f"the one given {reason}.",
                "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")],
            )
        return await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Gives every request an id (the client's X-Request-Id, or a new one),
    returns it in the X-Request-Id header, and logs one line per request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = None
        for name, value in scope.get("headers", []):
            if name.lower() == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info("request_id=%s method=%s path=%s status=%d duration_ms=%.1f", request_id,
                     scope["method"], scope["path"], status["code"], (time.perf_counter() - t0) * 1e3)


class HTTPMetricsMiddleware:
    """Counts HTTP requests by method, route template and status."""

    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.http.labels(scope["method"], template, str(status["code"])).inc()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses these itself
                return None
    return None


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` (--max-request-bytes) with a
    413 in OpenAI's envelope, without reading them whole: a Content-Length
    over the limit is refused unread, and a body without one (chunked) is
    counted as it arrives and cut off at the limit. A body within the limit
    is read here (at most ``max_bytes``) and handed on to the app."""

    def __init__(self, app, max_bytes: int, push_bytes: int | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.push_bytes = push_bytes or max_bytes  # PUT /v1/adapters/{name}/weights (--max-adapter-push-bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.push_bytes if is_push(scope["method"], scope["path"]) else self.max_bytes
        declared = _content_length(scope.get("headers", []))
        if declared is not None and declared > limit:
            return await self._refuse(send, f"{declared} bytes", limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(send, f"more than {limit} bytes", limit)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        del chunks

        async def replay():
            nonlocal body, replayed
            if replayed:
                return await receive()  # http.disconnect, for the routes that watch for it
            replayed, message = True, {"type": "http.request", "body": body, "more_body": False}
            body = b""
            return message

        return await self.app(scope, replay, send)

    async def _refuse(self, send, size: str, limit: int) -> None:
        flag = "--max-request-bytes" if limit == self.max_bytes else "--max-adapter-push-bytes"
        await _send_error(
            send, 413, f"The request body ({size}) is larger than this server accepts: at most "
            f"{limit} bytes ({flag}).", "invalid_request_error",
            "request_too_large", [(b"connection", b"close")],
        )
