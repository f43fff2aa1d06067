"""The control plane of base models: every declared base, its lifecycle, and
which of them are resident. No HTTP here: it imports neither FastAPI nor the
server, and a request holds a :class:`BaseLease` from :meth:`Bases.enter`.

Each loaded base is one :class:`ServerState` (its own engine thread and
stream, scheduler, slot packs, registry, loader, tokenizer, prompt lanes and
prompt cache), started by the ``start`` it is given (the server's
start_base: one start path for every base) and stopped by
:func:`close_state`. A request's ``model`` names a base or one of its
adapters; :meth:`Bases.enter` finds the base, loads it if it is not (the
request waits), and counts the request in flight on it until the lease is
released (the server does so when the response ends). Reaching
--max-loaded-models or --models-memory-bytes unloads the least recently used
idle base; a base with requests in flight is never unloaded, and when none
can be, the request gets a 503 with Retry-After. ``keep_alive`` unloads a
base idle that long (:meth:`Bases.unload_idle` takes ``now``). A base that
failed to load is tried again by the first request after
``retry_failed_after`` seconds, or at once by POST /v1/models/{id}/load
(:meth:`Bases.load`). What a base serves outlives its unloads: the
adapters loaded onto it over REST are known again when it loads again, and
those unloaded over REST stay unloaded. (The stored Responses outlive every
base: the app holds them.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import time
from typing import Awaitable, Callable

from ..config import ServeConfig
from ..errors import InvalidRequest, ShuttingDown
from ..frontend.state import ServerState
from .host_memory import trim_heap
from .lease import BaseLease
from .record import Base, BaseStatus, BaseUnavailable, default_name

log = logging.getLogger("mola.bases")
S = BaseStatus
# How a base is started: (its config, the shared metrics, adapters loaded over REST before it last unloaded)
# -> its state, serving (server/startup.py's start_base).
Start = Callable[[ServeConfig, object, tuple], Awaitable[ServerState]]


class Bases:
    """Every declared base, the default first; loads and unloads them. No
    HTTP here: a request holds a :class:`BaseLease` from :meth:`enter`."""

    def __init__(self, bases: list[Base], metrics, max_loaded: int | None = None,
                 max_bytes: int | None = None, clock: Callable[[], float] = time.monotonic,
                 start: Start | None = None, retry_failed_after: float = 30.0):
        self.by_name = {b.name: b for b in bases}
        self.default = bases[0]
        self.metrics = metrics  # shared by every base's state
        self.max_loaded, self.max_bytes = max_loaded, max_bytes
        self.clock = clock
        self.start = start  # how a base is started (server/startup.py's start_base): the one start path
        self.retry_failed_after = retry_failed_after  # seconds before a failed base is tried again
        self.draining = False
        self.handed: ServerState | None = None  # a state whose engine its starter stops, not this
        self.closed = False
        self._lock = asyncio.Lock()  # one load or unload decision at a time

    @classmethod
    def serving(cls, state: ServerState, **kwargs) -> Bases:
        """One base, loaded already as ``state`` (a server of one base). Its
        starter holds its model, so it stays loaded (pinned): ``mola serve
        --keep-alive`` serves one base through :meth:`declared` instead."""
        base = Base(state.base_id, state.config, None, pin=True, status=S.LOADED, state=state)
        base.nbytes, base.last_used = state.weight_bytes, time.monotonic()
        bases = cls([base], state.metrics, state.config.bases.max_loaded_models,
                     state.config.bases.models_memory_bytes,
                    **kwargs)
        bases.handed = state
        return bases

    @classmethod
    def declared(cls, config: ServeConfig, metrics, start: Start, **kwargs) -> Bases:
        """Every base ``config`` declares, none loaded: the default first (its
        --model, or the first of its models); ``start`` starts each of them."""
        specs = list(config.bases.models)
        if config.model is not None:
            name = config.served_model_name or default_name(config.model)
            first = Base(name, dataclasses.replace(config, served_model_name=name,
                                                   bases=dataclasses.replace(config.bases, models=())),
                         config.bases.keep_alive)
        else:
            spec = specs.pop(0)
            first = Base(spec.name, config.for_base(spec, is_default=True), spec.keep_alive or config.bases.keep_alive,
                         spec.pin)
        others = [Base(m.name, config.for_base(m), m.keep_alive or config.bases.keep_alive, m.pin) for m in specs]
        return cls([first, *others], metrics, config.bases.max_loaded_models, config.bases.models_memory_bytes,
                   start=start, **kwargs)

    async def preload(self) -> None:
        """Load the default base and the pinned ones (at start)."""
        for base in self:
            if base is self.default or base.pin:
                await self._admit(base)

    def __iter__(self):
        return iter(self.by_name.values())

    def loaded_states(self) -> list[ServerState]:
        return [b.state for b in self if b.state is not None]

    def find(self, model_id: str | None) -> Base | None:
        """The base ``model_id`` names, or whose adapter it is (None: none declares it)."""
        if model_id is None:
            return self.default
        if model_id in self.by_name:
            return self.by_name[model_id]
        return next((b for b in self if model_id in b.adapter_names()), None)

    # ---- requests ----------------------------------------------------------

    async def enter(self, model_id: str | None, stack: tuple[str, ...] = ()) -> BaseLease:
        """A lease on the base serving ``model_id`` (loaded now if need be):
        the request counts in flight on it until the lease is released."""
        base = self.find(model_id) or self.default  # an unknown id: the default base's 404
        for name in stack:
            other = self.find(name)
            if other is not None and other is not base:
                raise InvalidRequest(
                    f"'{name}' is an adapter of base '{other.name}' and '{model_id}' is served by base "
                    f"'{base.name}'; a stack holds adapters of one base.", param="adapters")
        if self.draining:
            raise ShuttingDown("The server is shutting down.")
        base.in_flight += 1
        base.last_used = self.clock()
        lease = BaseLease(base, self.leave)
        if base.status is not S.LOADED:
            try:
                await asyncio.shield(self._admit(base))  # a request that leaves lets the load finish
            except BaseException:
                lease.release()
                raise
        return lease

    def leave(self, base: Base) -> None:
        base.in_flight -= 1
        base.last_used = self.clock()

    async def load(self, name: str) -> Base:
        """Load the base ``name`` now (POST /v1/models/{id}/load): a base
        that failed is tried again at once, without waiting out its backoff."""
        base = self.by_name[name]
        if self.draining:
            raise ShuttingDown("The server is shutting down.")
        await asyncio.shield(self._admit(base, retry_now=True))
        return base

    async def _admit(self, base: Base, retry_now: bool = False) -> None:
        async with self._lock:
            if base.status is S.FAILED and not retry_now:
                wait = base.failed_at + self.retry_failed_after - self.clock()
                if wait > 0:
                    raise BaseUnavailable(f"The model '{base.name}' failed to load: {base.error} "
                                          f"(tried again in {math.ceil(wait)} s)", retry_after=math.ceil(wait))
            if base.status is S.LOADED:
                return
            await self._make_room(base)
            await self._load(base)
            await self._make_room(base, loaded=True)  # now that its size is known

    async def _make_room(self, base: Base, loaded: bool = False) -> None:
        """Unload idle bases, least recently used first, until ``base`` fits
        (``loaded``: it is loaded already, and goes on serving if nothing
        more can be freed)."""
        while not self._fits(base, loaded):
            idle = [b for b in self if b.status is S.LOADED and not b.pin and b.in_flight == 0 and b is not base]
            if not idle and loaded:
                log.warning("base %s is loaded at %.1f MiB and the loaded models are over --models-memory-bytes "
                            "%d: the others are busy; the next load makes room again", base.name,
                            base.nbytes / 2**20, self.max_bytes)
                return
            if not idle:
                raise BaseUnavailable(
                    f"The model '{base.name}' cannot be loaded now: the loaded models are busy "
                    f"(--max-loaded-models {self.max_loaded}, --models-memory-bytes {self.max_bytes}); "
                    "retry later.")
            await self._unload(min(idle, key=lambda b: b.last_used), "to make room for " + base.name)

    def _fits(self, base: Base, loaded: bool = False) -> bool:
        others = [b for b in self if b.status is S.LOADED and b is not base]
        if self.max_loaded is not None and len(others) + 1 > self.max_loaded:
            return False
        size = base.nbytes if loaded else base.size_guess()
        return self.max_bytes is None or sum(b.held_bytes for b in others) + size <= self.max_bytes

    # ---- loading and unloading ---------------------------------------------

    async def _load(self, base: Base) -> None:
        base.move(S.LOADING)
        t0 = time.perf_counter()
        log.info("loading base %s from %s", base.name, base.config.model)
        try:
            state = await self.start(base.config, self.metrics, base.rest_adapters)
        except Exception as e:  # its engine is stopped again
            base.error = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            base.failed_at = self.clock()
            base.move(S.FAILED)
            log.error("base %s failed to load: %s", base.name, base.error)
            raise BaseUnavailable(f"The model '{base.name}' failed to load: {base.error} (tried again in "
                                  f"{math.ceil(self.retry_failed_after)} s)",
                                  retry_after=math.ceil(self.retry_failed_after)) from None
        state.draining = self.draining
        base.state, base.nbytes, base.error = state, state.weight_bytes, None
        base.num_loads += 1
        base.move(S.LOADED)
        log.info("loaded base %s in %.2f s (%.1f MiB of weights; %s)",
                 base.name, time.perf_counter() - t0, base.nbytes / 2**20, state.engine.pack_stats.summary())

    async def _unload(self, base: Base, why: str) -> None:
        import mlx.core as mx

        base.move(S.UNLOADING)
        t0, before = time.perf_counter(), mx.get_active_memory()
        state, base.state = base.state, None
        base.remember_adapters(state.registry.adapters())
        await close_state(state)  # (its loader's pushed factors go with it)
        del state
        gc.collect()
        mx.clear_cache()
        trim_heap()
        base.num_unloads += 1
        base.move(S.DECLARED)
        log.info("unloaded base %s (%s) in %.2f s; %.1f MiB freed", base.name, why,
                 time.perf_counter() - t0, (before - mx.get_active_memory()) / 2**20)

    async def unload(self, name: str) -> bool:
        """Unload the base ``name`` now if it is loaded and idle."""
        async with self._lock:
            base = self.by_name[name]
            if base.status is not S.LOADED or base.in_flight:
                return False
            await self._unload(base, "asked")
            return True

    async def unload_idle(self, now: float) -> list[str]:
        """Unload every base idle past its keep_alive at ``now``; their names."""
        gone = []
        async with self._lock:
            for b in self:
                if (b.status is S.LOADED and not b.pin and b.in_flight == 0 and b.keep_alive is not None
                        and now - b.last_used >= b.keep_alive):
                    await self._unload(b, f"idle {now - b.last_used:.0f} s")
                    gone.append(b.name)
        return gone

    async def watch_idle(self, every: float = 1.0) -> None:
        """Forever: unload the bases idle past their keep_alive (a task of the app's lifespan)."""
        while True:
            await asyncio.sleep(every)
            await self.unload_idle(self.clock())

    def drain(self) -> int:
        """Shutting down: no new requests or loads; the sequences still running."""
        self.draining = True
        for state in self.loaded_states():
            state.draining = True
        return sum(s.active_sequences for s in self.loaded_states())

    async def close(self) -> None:
        """Stop serving every loaded base (at shutdown; once): each one's
        engine too, but for a handed state's, which its starter stops."""
        self.draining = True
        if self.closed:
            return
        self.closed = True
        for state in self.loaded_states():
            await close_state(state, stop_engine=state is not self.handed)


async def close_state(state: ServerState, stop_engine: bool = True) -> None:
    """Stop serving ``state``: its registry, loader, prompt lanes and engine
    thread. The one teardown of a base, as start_base is its one start."""
    state.draining = True
    state.registry.close()
    state.loader.close()
    state.prompts.close()
    if stop_engine:
        await asyncio.to_thread(state.engine.engine.stop)
