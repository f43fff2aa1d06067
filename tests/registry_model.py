"""The registry's side of admission in plain Python, on an explicit clock, for
tests/test_admission.py: slots kept as the registry's residency keeps them,
and requests that lease a resident adapter or wait in line, every change
running mola.registry.admission.admit as the registry runs it."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from mola.registry.admission import AdmissionQueue, admit
from mola.registry.records import AdapterRecord, AdapterState

S = AdapterState
UIDS = itertools.count(1)  # records' uids, as a registry's counter gives them


def rec(name: str, slot: int | None = None, last_used: float = 0.0, in_flight: int = 0) -> AdapterRecord:
    r = AdapterRecord(name=name, path=f"/{name}", source="rest", version=1, uid=next(UIDS))
    if slot is not None:
        r.state, r.slot, r.last_used, r.in_flight = S.RESIDENT, slot, last_used, in_flight
    return r


class Slots:
    """The SlotControl admit() drives, in plain Python, as the registry's
    residency keeps slots 1..n: a free slot first, else a drained yielding
    resident's, else the least recently used idle one's; slots 1..experts
    carry expert LoRA, which the adapters named in ``needs`` need."""

    def __init__(self, n: int, experts: int = 0, needs: frozenset[str] = frozenset()):
        self.holders: dict[int, AdapterRecord | None] = {s: None for s in range(1, n + 1)}
        self.experts, self.needs = experts, needs
        self.read: set[AdapterRecord] = set()  # rows in host memory
        self.installed: list[tuple[str, int]] = []

    def has_rows(self, record):
        return record in self.read

    def prefetch(self, record):
        self.read.add(record)  # read at once

    def carries(self, slot: int, record) -> bool:
        return record.name not in self.needs or slot <= self.experts

    def slot_for(self, record):
        ok = [s for s in self.holders if self.carries(s, record)]
        free = [s for s in ok if self.holders[s] is None]
        if free:
            self.holders[free[0]] = record  # reserved
            return free[0]
        idle = [self.holders[s] for s in ok if self.holders[s].is_evictable]
        if not idle:
            return None
        victim = min(idle, key=lambda r: (r.state is not S.YIELDING, r.last_used or 0.0, r.uid))
        slot, victim.slot = victim.slot, None
        victim.move_to(S.KNOWN)
        self.holders[slot] = record
        return slot

    def can_serve(self, resident, record):
        return self.carries(resident.slot, record)

    def install(self, record, slot):
        record.move_to(S.LOADING)
        record.move_to(S.RESIDENT)
        record.slot = slot
        self.installed.append((record.name, slot))

    def residents(self):
        return [r for r in self.holders.values() if r is not None and r.slot is not None]

    def set_yielding(self, record, yielding):
        record.move_to(S.YIELDING if yielding else S.RESIDENT)


@dataclass(eq=False)
class Request:
    name: str
    arrival: float
    hold: float  # how long its lease lasts
    started: float | None = None  # when it got its lease
    ticket: int | None = None


class Registry:
    """The registry's side of admission, on an explicit clock: a request for a
    resident adapter leases it at once, else waits in line; every change runs
    admit(); a lease ends ``hold`` after it starts."""

    def __init__(self, slots: Slots, max_wait: float = math.inf):
        self.slots, self.queue = slots, AdmissionQueue(max_wait)
        self.records: dict[str, AdapterRecord] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.leased: list[Request] = []  # in the order they got their leases
        self.max_yielding = max(1, len(slots.holders) // 4)  # as the registry's
        self.now = -1  # the last time run() stepped to

    def record(self, name: str) -> AdapterRecord:
        return self.records.setdefault(name, rec(name))

    def ask(self, name: str, now: float, hold: float) -> Request:
        request, record = Request(name, now, hold), self.record(name)
        if record.state is S.RESIDENT:
            self._lease(request, now)
        else:
            request.ticket = self.queue.join(record, now)
            record.waiting += 1
            self.waiting.append(request)
            self.admit(now)
        return request

    def cancel(self, request: Request, now: float) -> None:
        self._stop_waiting(request)
        self.admit(now)

    def _stop_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        self.record(request.name).waiting -= 1
        self.queue.leave(self.record(request.name), request.ticket)

    def advance(self, now: float) -> None:
        """Leases due by ``now`` end (each runs admit, as a release does)."""
        for request in [r for r in self.running if r.started + r.hold <= now]:
            self.running.remove(request)
            self.record(request.name).in_flight -= 1
            self.admit(now)
        self.admit(now)  # the registry's timer: a waiter may starve now

    def admit(self, now: float) -> None:
        admit(self.queue, self.slots, now, self.max_yielding)
        for request in [r for r in self.waiting if self.record(r.name).state is S.RESIDENT]:
            self._stop_waiting(request)
            self._lease(request, now)

    def _lease(self, request: Request, now: float) -> None:
        record = self.record(request.name)
        record.in_flight += 1
        record.last_used = request.started = now
        self.running.append(request)
        self.leased.append(request)

    def run(self, arrivals: list[tuple[float, str, float]], until: float) -> dict[str, list[Request]]:
        """(time, name, hold) arrivals, the clock stepped 1 unit at a time
        from where it stopped to ``until``."""
        due = sorted(arrivals, key=lambda a: a[0])
        made: dict[str, list[Request]] = {}
        for now in range(self.now + 1, until + 1):
            self.now = now
            self.advance(now)
            while due and due[0][0] <= now:
                _, name, hold = due.pop(0)
                made.setdefault(name, []).append(self.ask(name, now, hold))
        return made
