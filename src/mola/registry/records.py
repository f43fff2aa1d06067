"""One version of one adapter name, and the states it goes through.

A record's state changes only through :meth:`AdapterRecord.move_to`, which
checks it against :data:`TRANSITIONS`, the one table of allowed moves:

    KNOWN ---slot taken--> LOADING ---written--> RESIDENT ---evicted--> KNOWN (a stack: REMOVED)
    KNOWN <--write failed-- LOADING              RESIDENT ---unloaded--> DRAINING ---drained--> REMOVED
    KNOWN, LOADING ---unloaded--> REMOVED        RESIDENT <--needed no more-- YIELDING
    RESIDENT ---made to yield--> YIELDING ---drained, evicted--> KNOWN (a stack: REMOVED)
    YIELDING ---unloaded--> DRAINING

A YIELDING record still serves the requests it runs but takes no new ones
(they wait), so that it drains and its slot goes to an adapter whose request
has waited too long (mola.registry.admission). Reading an adapter from disk is
no state of its own: a KNOWN record may have its rows in the host tier
(``cached``) or a read in progress (mola.registry.host_tier).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class AdapterState(enum.Enum):
    KNOWN = "known"  # can be requested; in no slot
    LOADING = "loading"  # its slot is reserved and being written
    RESIDENT = "resident"  # in a slot, serving requests
    YIELDING = "yielding"  # in a slot, finishing its requests, taking no new ones: then evicted
    DRAINING = "draining"  # unloaded: finishing its running requests, then its slot frees
    REMOVED = "removed"  # gone for good: unloaded, replaced, or a stack evicted


S = AdapterState
TRANSITIONS: dict[AdapterState, frozenset[AdapterState]] = {
    S.KNOWN: frozenset({S.LOADING, S.REMOVED}),
    # written into its slot; the read or write failed; unloaded while loading
    S.LOADING: frozenset({S.RESIDENT, S.KNOWN, S.REMOVED}),
    # evicted (an adapter goes back to known, a stack is dropped); unloaded;
    # stopped from new leases to make room for a request that waited too long
    S.RESIDENT: frozenset({S.KNOWN, S.REMOVED, S.DRAINING, S.YIELDING}),
    # needed no more; drained and evicted (a stack is dropped); unloaded
    S.YIELDING: frozenset({S.RESIDENT, S.KNOWN, S.REMOVED, S.DRAINING}),
    S.DRAINING: frozenset({S.REMOVED}),
    S.REMOVED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A state change the table does not allow: a bug, never a user error."""


@dataclass(eq=False)
class AdapterRecord:
    """One version of one adapter name (or one stack of adapters)."""

    name: str
    path: str  # resolved path (or hub snapshot); `root` in /v1/models
    source: str  # "start", "dir", "rest", "resolver:dir", "resolver:hf", "request" (a path), "stack"
    version: int
    uid: int  # unique per version, from its registry's counter (tie-breaks in eviction and admission)
    # What its slot multiplies the adapter by: the scale it was loaded with
    # (POST /v1/adapters' "scale"), on top of its file's own.
    slot_scale: float = 1.0
    created: int = field(default_factory=lambda: int(time.time()))
    state: AdapterState = AdapterState.KNOWN
    slot: int | None = None
    in_flight: int = 0  # leases held by requests
    waiting: int = 0  # requests waiting for it to become resident
    cached: bool = False  # its slot rows are in the host tier
    last_used: float | None = None
    loads: int = 0
    rank: int | None = None  # known once read
    file_scale: float | None = None  # the scale its file gives (alpha / r), when its modules share one
    format: str | None = None
    nbytes: int | None = None
    expert_nbytes: int | None = None  # of nbytes, LoRA on experts: needs an expert slot when > 0
    targets: tuple[str, ...] | None = None  # the kinds of module it adapts, known once read
    invocation_tokens: tuple[int, ...] | None = None  # an activated LoRA's invocation, known once read
    kind: str | None = None  # "lora", "alora" or "dora", known once read
    vocab: dict | None = None  # its embedding/head parts (LoRA ranks, replaced token rows), known once read
    # A stack (several adapters in one slot): (path, scale) of each part, and
    # the part records it was built from.
    parts: tuple[tuple[str, float], ...] | None = None
    part_records: tuple["AdapterRecord", ...] = ()

    def move_to(self, state: AdapterState) -> None:
        """The one way a record changes state."""
        if state not in TRANSITIONS[self.state]:
            raise InvalidTransition(f"adapter '{self.name}' v{self.version}: {self.state.value} -> "
                                    f"{state.value} is not an allowed transition")
        self.state = state

    @property
    def is_stack(self) -> bool:
        return self.parts is not None

    @property
    def resident(self) -> bool:
        return self.state in (S.RESIDENT, S.YIELDING, S.DRAINING) and self.slot is not None

    @property
    def is_evictable(self) -> bool:
        """Resident, and no request uses it or waits for it; or yielding and
        drained (its waiters wait for it to come back later)."""
        if self.state is S.YIELDING:
            return self.in_flight == 0
        return self.state is S.RESIDENT and self.in_flight == 0 and self.waiting == 0

    @property
    def is_pinned(self) -> bool:
        """Requests run on it or wait for it: the host tier keeps its rows."""
        return self.in_flight > 0 or self.waiting > 0

    def touch(self) -> None:
        self.last_used = time.time()
        for part in self.part_records:
            part.last_used = self.last_used

    def describe(self) -> dict:
        """The record as /v1/adapters shows it (the HTTP API's field names)."""
        return {
            "name": self.name,
            # a stack's parts: each adapter's name, version and scale in the stack
            "parts": None if self.parts is None else [
                {"name": r.name, "version": r.version, "scale": sc}
                for r, (_, sc) in zip(self.part_records, self.parts)
            ],
            "path": self.path,
            "source": self.source,
            "format": self.format,
            "kind": self.kind,
            "state": self.state.value,
            "resident": self.resident,
            "cached": self.cached,
            "slot": self.slot,
            "version": self.version,
            "rank": self.rank,
            "slot_scale": self.slot_scale,  # the scale it was loaded with (POST /v1/adapters' "scale")
            "file_scale": self.file_scale,  # the scale its file gives (alpha / r)
            "nbytes": self.nbytes,
            "expert_nbytes": self.expert_nbytes,
            "targets": None if self.targets is None else list(self.targets),
            # an activated LoRA's invocation tokens (null: a plain LoRA)
            "alora_invocation_tokens": None if self.invocation_tokens is None else list(self.invocation_tokens),
            # LoRA on the token embedding / output head and trainable tokens (null: none, or not read yet)
            "vocab": self.vocab,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "loads": self.loads,
            "created": self.created,
            "last_used": self.last_used,
        }
