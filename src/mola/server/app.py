"""The FastAPI app. It is handed a running engine; at start-up it builds the
registry and loads the adapters named in the config."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..config import ServeConfig
from ..engine.client import AsyncEngine
from ..engine.engine import Engine, LoadedModel
from ..lora.loader import AdapterLoader
from ..lora.registry import AdapterRegistry
from .errors import error_response, install_error_handlers
from .routes import adapters, chat, models
from .state import ServerState

log = logging.getLogger("mola.server")


def base_model_id(config: ServeConfig, loaded: LoadedModel) -> str:
    if config.served_model_name:
        return config.served_model_name
    if loaded.path is not None:
        return loaded.path.name
    return config.model or "base"


def create_app(config: ServeConfig, engine: Engine, loaded: LoadedModel) -> FastAPI:
    """An app serving ``engine`` (already started, model loaded)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine = AsyncEngine(engine)
        loader = AdapterLoader(async_engine)
        base_id = base_model_id(config, loaded)
        state = ServerState(
            config=config,
            engine=async_engine,
            registry=AdapterRegistry(base_id, loader, config.max_loras),
            loader=loader,
            tokenizer=loaded.tokenizer,
            base_id=base_id,
            base_root=str(loaded.path or config.model),
            max_model_len=config.max_model_len or loaded.max_model_len,
        )
        app.state.mola = state
        try:
            for name, path in config.adapters:
                entry = await state.registry.load(name, path)
                log.info("serving adapter %s (rank %d) from %s", name, entry.rank, path)
            yield
        finally:
            loader.close()

    app = FastAPI(title="mola", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(models.router)
    app.include_router(adapters.router)

    @app.get("/health")
    async def health(request: Request):
        state: ServerState = request.app.state.mola
        if not state.engine.is_alive:
            return error_response(503, "The engine is not running.", "service_unavailable")
        return JSONResponse({"status": "ok"})

    return app
