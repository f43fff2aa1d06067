"""Starting a base: :func:`start_base` builds its engine, loads its model and
builds its :class:`ServerState` on the running event loop (the adapter
registry wired to the engine, the adapters named at start loaded). It is the
one start path: `mola serve` starts the first base and every further one with
it (through :class:`mola.bases.control.Bases`), and so do the tests' servers.
Its teardown is :func:`mola.bases.control.close_state`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

from ..adapters.loader import AdapterLoader
from ..config import AdapterSpec, ServeConfig
from ..engine.async_engine import AsyncEngine
from ..engine.engine import Engine, LoadedModel
from ..errors import MolaError
from ..registry.host_tier import HostTier
from ..registry.registry import AdapterRegistry
from ..registry.resolvers import make_resolvers
from ..registry.sources import AdapterSources
from ..structured import StructuredOutputs
from ..bases.host_memory import weight_bytes
from .metrics import Metrics
from ..frontend.reasoning import reasoning_format
from ..frontend.state import ServerState
from ..frontend.vision_prompt import vision_prompter

log = logging.getLogger("mola.server")


def model_loader(config: ServeConfig, group=None):
    """What an engine (or a follower rank) loads: --model (this rank's shard
    of it in a group: an mx.distributed group) and the whole --draft-model, if any."""
    from ..models.loader import base_loader

    spec = config.engine.speculative
    return base_loader(config.model, config.dtype, spec.draft_model if spec is not None else None, group)


def make_engine(config: ServeConfig, group=None) -> Engine:
    """A base's engine, not started (``group``: rank 0's place in a tensor-parallel group)."""
    return Engine(model_loader(config, group and group.group), config.engine, group=group)


async def start_base(config: ServeConfig, metrics: Metrics, registered: tuple[AdapterSpec, ...] = (), *,
                     group=None, engine_factory: Callable = make_engine) -> ServerState:
    """A base served: its engine started (its model loaded on the engine
    thread) and its state built over it. Raises what the load or an adapter
    named at start raised, with the engine stopped again."""
    engine = engine_factory(config, group)
    try:
        loaded = await asyncio.to_thread(engine.start)
        return await build_state(config, engine, loaded, metrics=metrics, registered=registered)
    except BaseException:
        await asyncio.to_thread(engine.stop)
        raise


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
        takes_images=loaded.takes_images,
        vision=vision_prompter(loaded, config),
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
