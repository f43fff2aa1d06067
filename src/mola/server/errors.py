"""Every error leaves the server in OpenAI's envelope:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Domain errors map to 4xx by class; malformed JSON and schema violations are
400s that name the field; anything unexpected is a 500 that is logged.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    AdapterDirExists,
    AdapterExists,
    AdapterNotFound,
    AdapterPathNotAllowed,
    AdapterPathNotFound,
    BaseBusy,
    EngineUnavailable,
    InvalidAdapter,
    InvalidAdapterName,
    InvalidRequest,
    KVBudgetExceeded,
    ModelNotFound,
    MolaError,
    Overloaded,
    PacksDoNotFit,
    PersistFailed,
    RequestTimedOut,
    ResponseNotFound,
    ShuttingDown,
)

log = logging.getLogger("mola.server")

# class -> (HTTP status, OpenAI error type, code)
STATUS: dict[type, tuple[int, str, str | None]] = {
    ModelNotFound: (404, "invalid_request_error", "model_not_found"),
    AdapterNotFound: (404, "invalid_request_error", "adapter_not_found"),
    ResponseNotFound: (404, "invalid_request_error", "response_not_found"),
    AdapterPathNotFound: (404, "invalid_request_error", "adapter_path_not_found"),
    AdapterPathNotAllowed: (403, "permission_error", "adapter_path_not_allowed"),
    AdapterExists: (409, "invalid_request_error", "adapter_exists"),
    BaseBusy: (409, "invalid_request_error", "model_busy"),
    AdapterDirExists: (409, "invalid_request_error", "adapter_dir_exists"),
    PersistFailed: (507, "server_error", "persist_failed"),
    PacksDoNotFit: (507, "server_error", "packs_do_not_fit"),
    KVBudgetExceeded: (400, "invalid_request_error", "kv_budget_exceeded"),
    InvalidAdapter: (400, "invalid_request_error", "invalid_adapter"),
    InvalidAdapterName: (400, "invalid_request_error", "invalid_adapter_name"),
    InvalidRequest: (400, "invalid_request_error", None),
    EngineUnavailable: (503, "service_unavailable", "engine_unavailable"),
    Overloaded: (429, "rate_limit_error", "queue_full"),
    ShuttingDown: (503, "service_unavailable", "shutting_down"),
    RequestTimedOut: (503, "service_unavailable", "request_timeout"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def status_of(exc: MolaError) -> tuple[int, str, str | None]:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500, "server_error", None


def error_payload(exc: MolaError) -> dict:
    """The envelope of ``exc``, e.g. for an error in the middle of a stream."""
    _, type_, code = status_of(exc)
    return error_body(exc.message, type_, exc.param, code)


def mola_error_response(exc: MolaError) -> JSONResponse:
    status, type_, code = status_of(exc)
    headers = None
    if getattr(exc, "retry_after", None) is not None:  # Overloaded, a base that cannot load now
        headers = {"Retry-After": str(exc.retry_after)}
    elif isinstance(exc, (ShuttingDown, EngineUnavailable)):
        headers = {"Retry-After": "5"}
    return error_response(status, exc.message, type_, exc.param, code, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}


def _loc_to_param(loc: tuple) -> str | None:
    """pydantic's error location -> OpenAI's ``param`` ("messages[0].role"),
    without the union-member tags pydantic inserts ("str", "list[int]")."""
    parts = [p for p in loc if p != "body" and not (
        isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "(" in p))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MolaError)
    async def _mola(request: Request, exc: MolaError):
        return mola_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return error_response(
                400, f"The request body is not valid JSON: {detail}".rstrip(": "),
                "invalid_request_error", None, "invalid_json",
            )
        param = _loc_to_param(tuple(first.get("loc", ())))
        msg = first.get("msg", "Invalid request")
        if first.get("type") == "missing" and param is None:  # no body at all
            message = "The request body is empty (or null); expected a JSON object."
        elif first.get("type") == "missing":
            message = f"Missing required parameter: '{param}'."
        elif first.get("type") in ("model_attributes_type", "dict_type") and param is None:
            message = "The request body must be a JSON object."
        else:
            message = f"Invalid value for '{param}': {msg}." if param else f"{msg}."
        if len(errors) > 1:
            message += f" ({len(errors) - 1} more error(s) in the request body.)"
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        return error_response(exc.status_code, message, type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500, f"Internal server error: {type(exc).__name__}", "server_error", None, "internal_error"
        )
