"""The FastAPI app. :func:`build_state` wires a running engine to the adapter
registry (on the event loop) and loads the configured adapters;
:func:`create_app` serves that state."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..blas import blas_in_use
from ..config import ServeConfig
from ..engine.client import AsyncEngine
from ..engine.engine import Engine, LoadedModel
from ..errors import MolaError
from ..registry.host_tier import HostTier
from ..adapters.loader import AdapterLoader
from ..registry.registry import AdapterRegistry
from ..registry.resolvers import make_resolvers
from ..registry.sources import AdapterSources
from ..structured import StructuredOutputs
from .anthropic.errors import AnthropicErrorsMiddleware
from .errors import error_response, install_error_handlers
from .middleware import AuthMiddleware, BodyLimitMiddleware, HTTPMetricsMiddleware, RequestIdMiddleware
from .reasoning import reasoning_format
from .responses_api.store import ResponseStore
from .routes import adapters, chat, completions, messages, models, responses, tokenize, ui, vllm
from .state import ServerState

log = logging.getLogger("mola.server")


def base_model_id(config: ServeConfig, loaded: LoadedModel) -> str:
    if config.served_model_name:
        return config.served_model_name
    if loaded.path is not None:  # a model directory's name, a GGUF file's stem
        return loaded.path.stem if loaded.path.is_file() else loaded.path.name
    return config.model or "base"


async def build_state(config: ServeConfig, engine: Engine, loaded: LoadedModel) -> ServerState:
    """Everything the routes share, on the running event loop; checks and
    loads the adapters named at start (raising MolaError for a bad one) and
    registers every entry of the adapter directories."""
    async_engine = AsyncEngine(engine)
    loader = AdapterLoader(port=async_engine, model_config=loaded.config)  # the engine is its SlotPort
    base_id = base_model_id(config, loaded)
    sources = AdapterSources(
        adapter_dirs=config.adapter_dirs,
        named_paths=[a.path for a in config.adapters if Path(a.path).expanduser().exists()],
        allow_any_path=config.allow_any_adapter_path,
        allow_symlinks=config.allow_adapter_symlinks,
        resolver_dirs=[r.root for r in config.adapter_resolvers if r.kind == "dir"],
    )
    tier = HostTier(config.max_cpu_loras, config.adapter_cache_bytes)
    registry = AdapterRegistry(base_id, loader, config.engine.max_loras, sources, forget=async_engine.forget_prompts,
                               resolvers=make_resolvers(config.adapter_resolvers, sources),
                               tier=tier, max_wait=config.max_adapter_wait,
                               expert_slots=loader.geometry.expert_slots)
    state = ServerState(
        config=config,
        engine=async_engine,
        registry=registry,
        loader=loader,
        tokenizer=loaded.tokenizer,
        base_id=base_id,
        base_root=str(loaded.path or config.model),
        max_model_len=config.max_model_len or loaded.max_model_len,
        vocab_size=loaded.vocab_size,
        responses=ResponseStore(config.max_stored_responses),
        structured=StructuredOutputs(loaded.tokenizer, loaded.vocab_size),
        reasoning=reasoning_format(config.reasoning_parser, loaded.tokenizer),
    )
    if state.reasoning is not None:
        log.info("reasoning parser: %s", state.reasoning.name)
    try:
        for spec in config.adapters:
            try:
                record = await registry.load(spec.name, spec.path, spec.scale, source="start")
            except MolaError as e:
                raise type(e)(f"could not load adapter '{spec.name}' from {spec.path}: {e.message}") from e
            log.info("serving adapter %s (rank %s) from %s", spec.name, record.rank, record.path)
        for name, path in sources.scan().items():
            if name in (a.name for a in config.adapters) or name == base_id:
                continue
            registry.register(name, path, "dir")
    except BaseException:
        loader.close()
        raise
    return state


def create_app(state: ServerState) -> FastAPI:
    """An app serving ``state`` (engine started, adapters loaded)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            state.draining = True
            state.registry.close()
            state.loader.close()
            state.prompts.close()

    app = FastAPI(title="mola", version="0.1.0", lifespan=lifespan)
    app.state.mola = state
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(models.router)
    app.include_router(adapters.router)
    app.include_router(vllm.router)
    app.include_router(tokenize.router)
    if state.config.ui:
        ui.install(app)  # the playground at /
    state.metrics.watch(state)

    blas = blas_in_use()  # what the engine's CPU matmuls run on (fixed for the process)

    @app.get("/health")
    async def health(request: Request):
        if not state.engine.is_alive:
            return error_response(503, "The engine is not running.", "service_unavailable",
                                  code="engine_unavailable")
        if state.draining:
            return error_response(503, "The server is shutting down.", "service_unavailable",
                                  code="shutting_down")
        return JSONResponse({"status": "ok", "blas": blas})

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # The last added runs first: request id, Anthropic's error envelope (on /v1/messages), auth,
    # metrics, body limit.
    config = state.config
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics)
    app.add_middleware(AuthMiddleware, api_key=config.api_key, admin_key=config.admin_key,
                       protect_metrics=config.protect_metrics)
    app.add_middleware(AnthropicErrorsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    return app
