"""`mola serve`: load the base model on the engine thread, then run the HTTP
server until it is stopped."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import logging
import os
import sys
import time

from .config import AdapterSpec, ModelSpec, ServeConfig

log = logging.getLogger("mola")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # transformers warns that PyTorch is missing; mola never needs it.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


ECHO_PREFIX = "echo-"  # the echo demo's adapters beside the chat demo's (both have a `title`)


def with_demo(config: ServeConfig) -> ServeConfig:
    """With no --model, the embedded demo (mola.demo): the chat demo's base and
    adapters, and the echo demo's tiny base as a second base with its adapters
    (named echo-upper, ...), loaded on its first request; the echo demo alone
    when asked for (--demo echo), or when the chat demo's model cannot be had."""
    if config.model is not None or config.bases.models:
        return config
    from .demo import ensure_demo

    demo = ensure_demo(config.cache_dir, config.demo)
    names = {a.name for a in config.adapters}
    demo_adapters = tuple(AdapterSpec(n, str(p)) for n, p in demo.adapters.items() if n not in names)
    models = ()
    if demo.kind == "chat" and not config.distributed:  # --distributed serves one base
        echo = ensure_demo(config.cache_dir, "echo")
        models = (ModelSpec(echo.name, str(echo.model), adapters=tuple(
            AdapterSpec(ECHO_PREFIX + n, str(p)) for n, p in echo.adapters.items())),)
    return dataclasses.replace(
        config,
        model=str(demo.model),
        demo=ServeConfig.demo,  # the demo is now the model: no choice is left to make
        served_model_name=config.served_model_name or demo.name,
        adapters=demo_adapters + config.adapters,
        bases=dataclasses.replace(config.bases, models=models),
    )


def join_group():
    """This process's place in the mx.distributed group mlx.launch started."""
    import mlx.core as mx

    from .engine.distributed import Group

    try:
        group = mx.distributed.init(strict=True)
    except Exception as e:
        print(f"[mola] error: --distributed needs a group started by mlx.launch ({e}); e.g.\n"
              "  mlx.launch --backend ring -n 2 -- mola serve --distributed --model ...",
              file=sys.stderr)
        return None
    if group.size() < 2:
        print("[mola] error: --distributed with a group of 1; run without it", file=sys.stderr)
        return None
    print(f"[mola] rank {group.rank()} of {group.size()}", file=sys.stderr, flush=True)
    return Group(group)


def follow(config: ServeConfig, group) -> int:
    """A rank other than 0: hold a shard, replay rank 0's steps, no HTTP."""
    from .engine.distributed import run_follower
    from .server.startup import model_loader
    from .structured import StructuredOutputs

    def grammars(loaded):  # each rank compiles its own matchers from rank 0's grammar text
        return StructuredOutputs(loaded.tokenizer, loaded.vocab_size).rebuild

    return run_follower(model_loader(config, group.group), config.engine, group, grammars)


def exposure_warning(config: ServeConfig) -> str | None:
    """A warning when the server listens beyond this machine with no API key."""
    if config.http.api_key is not None:
        return None
    host = config.http.host.strip("[]")
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to anything
        pass
    return (f"listening on {config.http.host or 'every address'}, beyond this machine, with no --api-key: "
            "anyone who can reach the port can use the models (and, with no --admin-key, load and "
            "unload adapters). Set --api-key (or MOLA_API_KEY), or bind --host 127.0.0.1.")


def serve(config: ServeConfig) -> int:
    setup_logging(config.log_level)
    config = with_demo(config)
    several = bool(config.bases.models) or config.bases.keep_alive is not None  # bases loaded and unloaded here
    if config.distributed and several:
        print("[mola] error: --distributed serves one base, loaded for good; it cannot go with "
              "--model NAME=PATH, [[models]] or --keep-alive", file=sys.stderr)
        return 1
    group = None
    if config.distributed:
        group = join_group()
        if group is None:
            return 1
        if not group.is_leader:
            return follow(config, group)
    warning = exposure_warning(config)
    if warning:  # printed whatever --log-level says, by rank 0 alone (it alone listens)
        print(f"[mola] warning: {warning}", file=sys.stderr, flush=True)
    try:
        return asyncio.run(_serve(config, group))
    except KeyboardInterrupt:
        return 0


async def _serve(config: ServeConfig, group) -> int:
    """Every base the same way (server/startup.py's start_base): the default
    (and the pinned ones) now, the others on their first request."""
    from .server.app import create_app
    from .bases.control import Bases, BaseUnavailable
    from .bases.host_memory import limit_malloc_arenas
    from .server.metrics import Metrics
    from .server.startup import start_base

    limit_malloc_arenas()  # engines come and go: keep what they free reusable
    bases = Bases.declared(config, Metrics(), functools.partial(start_base, group=group))
    others = [b.name for b in bases if b is not bases.default]
    print(f"[mola] loading {bases.default.config.model} ..." + (f" (and, when asked for, {', '.join(others)})"
                                                              if others else ""), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        try:
            await bases.preload()
        except BaseUnavailable as e:
            failed = next((b for b in bases if b.error is not None), None)
            print(f"[mola] error: {failed.error if failed else e.message}", file=sys.stderr, flush=True)
            return 1
        print(f"[mola] model loaded in {time.perf_counter() - t0:.1f} s; {capacity(config, bases.default.state)}",
              file=sys.stderr, flush=True)
        return await _run(config, create_app(bases.default.state, bases))
    finally:
        await bases.close()  # after the app's own close, nothing is left to do


def capacity(config: ServeConfig, state) -> str:
    """What a loaded base holds adapters in: its slots and their ceilings."""
    g = state.engine.geometry
    experts = (f", {g.expert_slots} of them also on the {g.num_experts} experts at rank <= {g.max_expert_rank} "
               f"({g.expert_slot_bytes / 2**20:.1f} MiB each at most)" if g.expert_slots else "")
    return (f"{config.engine.max_loras} adapter slots of rank <= {config.engine.max_lora_rank}{experts}; "
            f"slot packs sized to the adapters loaded (up to {g.max_pack_bytes / 2**20:.1f} MiB at these ceilings)")


async def _run(config: ServeConfig, app) -> int:
    """Serve ``app`` until SIGTERM / SIGINT, then drain every base's engine."""
    import uvicorn

    bases = app.state.bases

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # SIGTERM / SIGINT: take no new generations (503), let running
            # ones finish within --shutdown-timeout, then exit.
            if not bases.draining:
                running = bases.drain()
                print(f"[mola] shutting down: draining {running} running "
                      f"sequence(s) for up to {config.http.shutdown_timeout:g} s", file=sys.stderr, flush=True)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal once it has stopped, which would
            # end the process "killed by SIGTERM"; a drained stop exits 0.
            self._captured_signals.clear()

    server = Server(uvicorn.Config(
        app, host=config.http.host, port=config.http.port, log_level=config.log_level,
        timeout_graceful_shutdown=config.http.shutdown_timeout,
    ))
    await server.serve()
    return 0
