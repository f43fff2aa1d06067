"""Fair admission to adapter slots: who gets the next slot, and when a busy
resident must make room.

Plain Python on the event loop, no arrays. Requests that find their adapter
out of a slot wait here; each waiting adapter counts from its oldest waiting
request, and all of an adapter's waiters are admitted together when it gets a
slot (one load serves them all). Slots go to waiting adapters as they free up
(a free slot, or the least recently used resident nobody uses), the adapter
with the most waiting requests first, which fills the decode batch fastest
when more adapters are wanted than there are slots.

That alone starves cold adapters when every slot is held by adapters with
continuous traffic: their requests overlap, so they never go idle; and
grouping alone would pass over an adapter with one request forever. So a
request that has waited ``max_wait`` seconds (--max-adapter-wait) makes its
adapter *starving*: slots then go to starving adapters only, oldest first,
and for each starving adapter that finds no slot, one busy resident is made
to yield (AdapterState.YIELDING): it finishes the requests it runs but takes
no new ones (they wait, counted from their arrival like anyone's), so it
drains and its slot goes to the starving adapter. At most a quarter of the
slots (at least one) yield at once: when more adapters starve than that, as
under overload, the others wait their turn, oldest first, and the rest of the
slots keep taking requests, which keeps the batch full. The resident chosen is the
one likely to drain soonest: the least recently used (no request has come
for it for the longest time, so its running ones are the oldest), then the
one with fewest requests in flight. The worst wait for a slot is therefore
about ``max_wait`` plus what remains of the requests running on the yielding
adapter, plus the slot write.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

from .records import AdapterRecord, AdapterState

S = AdapterState


class SlotControl(Protocol):
    """The levers admission pulls on the slots (residency.Residency carries
    them out); not the engine's SlotPort, which the writes go through."""

    def has_rows(self, record: AdapterRecord) -> bool:
        """Its slot rows are ready in host memory."""

    def prefetch(self, record: AdapterRecord) -> None:
        """Start reading it on the reader thread, unless done or under way."""

    def slot_for(self, record: AdapterRecord) -> int | None:
        """Reserve a free slot that can carry ``record`` (its rows read), or
        evict an idle (or drained yielding) resident for one; None if every
        such slot is busy."""

    def can_serve(self, resident: AdapterRecord, record: AdapterRecord) -> bool:
        """Could ``resident``'s slot carry ``record`` (an expert slot for an
        adapter with expert LoRA)?"""

    def install(self, record: AdapterRecord, slot: int) -> None:
        """Write its rows into the reserved ``slot`` and admit its waiters."""

    def residents(self) -> list[AdapterRecord]:
        """Records in slots."""

    def set_yielding(self, record: AdapterRecord, yielding: bool) -> None:
        """Stop (or resume) new leases on a resident."""


@dataclass
class AdmissionStats:
    admitted: int = 0  # adapters given a slot for waiting requests
    starved: int = 0  # of those, adapters whose oldest request had waited max_wait
    yields: int = 0  # residents made to yield their slot
    yields_cancelled: int = 0  # yielding residents kept after all (the need went away)
    max_wait_seconds: float = 0.0  # the longest any admitted adapter's oldest request waited


class AdmissionQueue:
    """Adapters waiting for a slot, with the arrival time of each waiting request."""

    def __init__(self, max_wait: float = math.inf):
        if not max_wait > 0:
            raise ValueError(f"max_wait must be > 0 seconds, got {max_wait}")
        self.max_wait = max_wait
        self.stats = AdmissionStats()
        self._waits: dict[AdapterRecord, dict[int, float]] = {}  # record -> {ticket: arrival}
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._waits)

    def join(self, record: AdapterRecord, now: float) -> int:
        """A request for ``record`` starts waiting; returns its ticket."""
        ticket = next(self._tickets)
        self._waits.setdefault(record, {})[ticket] = now
        return ticket

    def leave(self, record: AdapterRecord, ticket: int) -> None:
        """A request stops waiting (admitted, failed, cancelled or timed out)."""
        waits = self._waits.get(record)
        if waits is not None:
            waits.pop(ticket, None)
            if not waits:
                del self._waits[record]

    def discard(self, record: AdapterRecord) -> None:
        """Forget every request waiting for ``record`` (they are failed)."""
        self._waits.pop(record, None)

    def since(self, record: AdapterRecord) -> float:
        """Arrival time of the oldest request waiting for ``record``."""
        return min(self._waits[record].values())

    def ordered(self) -> list[AdapterRecord]:
        """Waiting adapters, the one whose request has waited longest first."""
        return sorted(self._waits, key=lambda r: (self.since(r), r.uid))

    def turn_order(self, now: float) -> list[AdapterRecord]:
        """Who gets the next slots: starving adapters, longest wait first;
        then the others, most waiting requests first (one load admits them
        all, which fills the batch), then longest wait."""
        ordered = self.ordered()
        starving = [r for r in ordered if self.is_starving(r, now)]
        rest = [r for r in ordered if not self.is_starving(r, now)]
        return starving + sorted(rest, key=lambda r: -len(self._waits[r]))

    def is_starving(self, record: AdapterRecord, now: float) -> bool:
        return now - self.since(record) >= self.max_wait

    def next_starving_at(self, now: float) -> float | None:
        """When the next waiting adapter that is not starving yet will be."""
        times = [self.since(r) + self.max_wait for r in self._waits]
        later = [t for t in times if t > now]
        return min(later) if later else None

    def admitted(self, record: AdapterRecord, now: float) -> None:
        """``record`` got a slot for its waiters: account for their wait."""
        if record not in self._waits:
            return
        waited = now - self.since(record)
        self.stats.admitted += 1
        self.stats.starved += waited >= self.max_wait
        self.stats.max_wait_seconds = max(self.stats.max_wait_seconds, waited)


def pick_yielder(residents: list[AdapterRecord]) -> AdapterRecord | None:
    """Of the residents running requests, the one likely to drain soonest:
    the least recently used (its newest request is the oldest of anyone's),
    then the one with fewest requests in flight; None if none."""
    candidates = [r for r in residents if r.in_flight > 0]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.last_used or 0.0, r.in_flight, r.uid))


def admit(queue: AdmissionQueue, control: SlotControl, now: float, max_yielding: int = 1) -> None:
    """Give slots to waiting adapters in turn order (starving ones first,
    then those with most waiting requests), and make busy residents yield
    for the starving ones that find none, at most ``max_yielding`` at a time
    (see the module's doc). Every waiting adapter not yet read is prefetched."""
    waiting = [r for r in queue.turn_order(now) if r.state is S.KNOWN]
    for record in waiting:
        if not control.has_rows(record):
            control.prefetch(record)
    blocked: list[AdapterRecord] = []  # starving adapters without a slot
    for record in waiting:
        starving = queue.is_starving(record, now)
        if blocked and not starving:
            break  # the next slot that frees is a starving adapter's
        if not control.has_rows(record):
            if starving:  # its read is under way: others may go first, unless it starves
                blocked.append(record)
            continue
        slot = control.slot_for(record)
        if slot is None:
            if not starving:
                break
            blocked.append(record)
            continue
        queue.admitted(record, now)
        control.install(record, slot)
    _reconcile_yields(queue, control, blocked[:max_yielding])


def _reconcile_yields(queue: AdmissionQueue, control: SlotControl, starving: list[AdapterRecord]) -> None:
    """One yielding resident, whose slot can carry it, per starving adapter
    without a slot (``starving``, already capped); extra ones are taken back
    (those with most requests in flight first)."""
    residents = control.residents()
    yielding = sorted((r for r in residents if r.state is S.YIELDING), key=lambda r: r.in_flight)
    kept: list[AdapterRecord] = []
    for record in starving:
        match = next((y for y in yielding if y not in kept and control.can_serve(y, record)), None)
        if match is None:
            match = pick_yielder([r for r in residents if r.state is S.RESIDENT and r not in kept
                                  and control.can_serve(r, record)])
            if match is None:
                continue
            control.set_yielding(match, True)
            queue.stats.yields += 1
        kept.append(match)
    for extra in yielding:
        if extra not in kept:
            control.set_yielding(extra, False)
            queue.stats.yields_cancelled += 1
