"""A base's :class:`ServerState`, built on the running event loop from an
engine client whose engine has loaded its model: the adapter registry wired to the engine,
and the adapters named at start loaded."""

from __future__ import annotations

import logging
from pathlib import Path

from ..adapters.loader import AdapterLoader
from ..config import AdapterSpec, ServeConfig
from ..engine.client import AsyncEngine
from ..engine.engine import Engine, LoadedModel
from ..errors import MolaError
from ..registry.host_tier import HostTier
from ..registry.registry import AdapterRegistry
from ..registry.resolvers import make_resolvers
from ..registry.sources import AdapterSources
from ..structured import StructuredOutputs
from .host_memory import weight_bytes
from .metrics import Metrics
from ..frontend.reasoning import reasoning_format
from ..frontend.state import ServerState

log = logging.getLogger("mola.server")


def base_model_id(config: ServeConfig, loaded: LoadedModel) -> str:
    if config.served_model_name:
        return config.served_model_name
    if loaded.path is not None:  # a model directory's name, a GGUF file's stem
        return loaded.path.stem if loaded.path.is_file() else loaded.path.name
    return config.model or "base"


async def build_state(config: ServeConfig, engine: Engine, loaded: LoadedModel,
                      metrics: Metrics | None = None, registered: tuple[AdapterSpec, ...] = ()) -> ServerState:
    """A base's state over ``engine``, which has loaded ``loaded`` (see serve_state)."""
    return await serve_state(config, AsyncEngine(engine), loaded, metrics, registered, kv_budget=engine.kv_budget,
                             nbytes=weight_bytes(loaded.model) - engine.pack_stats.nbytes)


async def serve_state(config: ServeConfig, async_engine, loaded: LoadedModel, metrics: Metrics | None = None,
                      registered: tuple[AdapterSpec, ...] = (), kv_budget=None, nbytes: int = 0) -> ServerState:
    """Everything the routes share, on the running event loop, over an engine
    client (an :class:`AsyncEngine`, or anything with its methods: the tests'
    scripted one). Checks and loads the adapters named at start (raising
    MolaError for a bad one) and registers every entry of the adapter
    directories, and the ``registered`` adapters (loaded over REST before the
    base last unloaded: read on first use, so that one whose file has gone
    fails its own requests only)."""
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
        structured=StructuredOutputs(loaded.tokenizer, loaded.vocab_size),
        reasoning=reasoning_format(config.reasoning_parser, loaded.tokenizer),
        kv_budget=kv_budget,
        metrics=metrics or Metrics(),  # several bases share the app's
        weight_bytes=nbytes,
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
        named = {a.name for a in (*config.adapters, *registered)}
        for name, path in sources.scan().items():
            if name in named or name == base_id:
                continue
            registry.register(name, path, "dir")
        for spec in registered:
            sources.allow(spec.path)
            registry.register(spec.name, spec.path, "rest", spec.scale)
    except BaseException:
        loader.close()
        raise
    return state
