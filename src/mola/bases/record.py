"""One declared base model (:class:`Base`): its settings, its status and
the transitions between them, and what it serves while not loaded."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

from ..config import AdapterSpec, ServeConfig
from ..errors import EngineUnavailable
from ..registry.sources import AdapterSources
from ..frontend.state import ServerState
from .host_memory import planned_bytes


class BaseStatus(enum.Enum):
    DECLARED = "declared"  # known, not loaded
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"  # its load failed: its requests get a 503 naming why


S = BaseStatus
TRANSITIONS = {
    S.DECLARED: {S.LOADING},
    S.LOADING: {S.LOADED, S.FAILED},
    S.LOADED: {S.UNLOADING},
    S.UNLOADING: {S.DECLARED},
    S.FAILED: {S.LOADING},  # tried again once retry_failed_after has passed
}


class BaseUnavailable(EngineUnavailable):
    """A base that failed to load, or one no room can be made for (503, Retry-After)."""

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class Base:
    """One declared base model and, while loaded, the state serving it."""

    name: str
    config: ServeConfig  # what it is served with (model, adapters, engine)
    keep_alive: float | None = None  # seconds idle before it unloads
    pin: bool = False  # never unloaded
    status: BaseStatus = S.DECLARED
    state: ServerState | None = None  # while loaded
    in_flight: int = 0  # requests on it whose response has not ended
    last_used: float = 0.0  # when a request last entered or left it (the clock's time)
    nbytes: int = 0  # its weights, as measured at its last load (held_bytes adds its slot packs now)
    planned: int | None = None  # before its first load: what its files will take (size_guess)
    error: str | None = None  # why it failed to load
    failed_at: float | None = None  # when (the clock's time)
    # Adapters loaded onto it over REST, as they were when it last unloaded:
    # known again (read on first use) when it loads again.
    rest_adapters: tuple[AdapterSpec, ...] = ()
    num_loads: int = 0
    num_unloads: int = 0

    def move(self, to: BaseStatus) -> None:
        if to not in TRANSITIONS[self.status]:
            raise AssertionError(f"base '{self.name}': {self.status.value} -> {to.value} is not a transition")
        self.status = to

    def adapter_paths(self) -> dict[str, str]:
        """The adapters it serves, name -> path: its registry's while loaded;
        otherwise those named at start, loaded over REST and in its adapter dirs."""
        if self.state is not None:
            return {r.name: r.path for r in self.state.registry.adapters()}
        paths = {a.name: a.path for a in (*self.config.adapters, *self.rest_adapters)}
        found = AdapterSources(adapter_dirs=self.config.adapter_dirs).scan()
        return paths | {n: str(p) for n, p in found.items() if n not in paths}

    def adapter_names(self) -> set[str]:
        return set(self.adapter_paths())

    @property
    def held_bytes(self) -> int:
        """Its weights and its slot packs as they are now (they grow with the adapters loaded)."""
        return self.nbytes + (self.state.engine.pack_stats.nbytes if self.state is not None else 0)

    def size_guess(self) -> int:
        """Its bytes as measured at its last load; before its first, what its
        files will take as loaded (a GGUF file's plan, tensor by tensor, in
        the dtype it is served in; else its weight files: slot packs come on
        top, and the load's measure corrects it)."""
        if not self.nbytes and self.planned is None:
            self.planned = planned_bytes(self.config.model, self.config.dtype)
        return self.nbytes or self.planned

    def remember_adapters(self, records) -> None:
        """On unloading: keep what its registry serves by name for the next
        load (start adapters unloaded over REST are dropped from it)."""
        kept = {r.name for r in records if r.source == "start"}
        self.config = dataclasses.replace(self.config, adapters=tuple(a for a in self.config.adapters if a.name in kept))
        self.rest_adapters = tuple(AdapterSpec(r.name, r.path, r.slot_scale) for r in records if r.source == "rest")


def default_name(model: str) -> str:
    """The id of a base named by its source only: a directory's name, a GGUF file's stem, a hub id's tail."""
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name or model
