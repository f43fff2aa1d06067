"""The FastAPI app: :func:`create_app` serves a base's state (built by
server/startup.py) and, with several bases, the others as they load."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..blas import blas_in_use
from ..images.service import ImageService
from .base_leases import BaseLeases
from ..bases.control import Bases
from .anthropic.errors import AnthropicErrorsMiddleware
from .responses_api.store import ResponseStore
from .errors import error_response, install_error_handlers
from .middleware import AuthMiddleware, BodyLimitMiddleware, HTTPMetricsMiddleware, RequestIdMiddleware
from .routes import adapters, chat, completions, images, messages, models, responses, tokenize, ui, vllm
from ..frontend.state import ServerState

log = logging.getLogger("mola.server")


def create_app(state: ServerState, bases: Bases | None = None) -> FastAPI:
    """An app serving ``state`` (engine started, adapters loaded), the default
    base of ``bases`` when several are declared."""
    bases = bases or Bases.serving(state)
    # The image base (docs/images.md): its worker thread loads it as the app starts.
    image_service = ImageService.from_config(state.config) if state.config.images.model is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if image_service is not None:
            await asyncio.to_thread(image_service.start)
        idle = asyncio.create_task(bases.watch_idle())  # keep_alive
        try:
            yield
        finally:
            idle.cancel()
            if image_service is not None:
                await asyncio.to_thread(image_service.stop)
            await bases.close()  # every base's one teardown (a handed state's engine: its starter's)

    app = FastAPI(title="mola", version="0.1.0", lifespan=lifespan)
    app.state.bases = bases
    # Stored Responses belong to the server, not to a base: they outlive a
    # base's unload, and a follow-up may name another model.
    app.state.responses = ResponseStore(state.config.max_stored_responses)
    app.state.images = image_service
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(models.router)
    app.include_router(adapters.router)
    app.include_router(vllm.router)
    app.include_router(tokenize.router)
    app.include_router(images.router)
    if state.config.http.ui:
        ui.install(app)  # the playground at /
    state.metrics.watch(lambda: bases.default.state, bases)

    blas = blas_in_use()  # what the engine's CPU matmuls run on (fixed for the process)

    def kv_health(kv) -> dict:
        """A loaded base's KV budget and what its batches hold of it (bytes; budget null: none)."""
        return {"budget": kv.budget_bytes or None, "admission": kv.mode or None, "used": kv.used_bytes,
                "reserved": kv.reserved_bytes, "free": kv.free_bytes, "held": kv.held_bytes,
                "preemptions": kv.preemptions, "waits": kv.waits}

    @app.get("/health")
    async def health(request: Request):
        if not all(s.engine.is_alive for s in bases.loaded_states()):
            return error_response(503, "The engine is not running.", "service_unavailable",
                                  code="engine_unavailable")
        if bases.draining or any(s.draining for s in bases.loaded_states()):
            return error_response(503, "The server is shutting down.", "service_unavailable",
                                  code="shutting_down")
        loaded = [b for b in bases if b.state is not None]
        return JSONResponse({"status": "ok", "blas": blas, "kv_cache": {
            b.name: kv_health(b.state.engine.snapshot.kv) for b in loaded},
            "lora_packs": {b.name: b.state.engine.pack_stats.describe() for b in loaded}})

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # The last added runs first: request id, Anthropic's error envelope (on /v1/messages), auth,
    # metrics, body limit.
    config = state.config
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.http.max_request_bytes,
                       push_bytes=config.http.max_adapter_push_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics)
    app.add_middleware(AuthMiddleware, api_key=config.http.api_key, admin_key=config.http.admin_key,
                       protect_metrics=config.http.protect_metrics)
    app.add_middleware(AnthropicErrorsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(BaseLeases, bases=bases)  # outermost: a request's lease ends with its response
    return app
