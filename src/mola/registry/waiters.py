"""Requests waiting for their adapter to take a slot: the admission queue (who
goes first), the one future per record that its waiters await, and the
admission pass that hands out slots (mola.registry.admission decides who; a
timer runs it again when the next waiter starts to starve).

The registry (requests join, await and leave) and residency (a record placed,
a read failed, a slot freed) both hold the one Waiters, so that neither calls
back into the other. Plain Python on the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time

from .admission import AdmissionQueue, SlotControl, admit
from .records import AdapterRecord, AdapterState


class Waiters:
    def __init__(self, max_wait: float = math.inf, max_yielding: int = 1):
        self.queue = AdmissionQueue(max_wait)  # requests waiting for a slot
        self.max_yielding = max_yielding  # residents made to yield at once, at most
        self._futures: dict[AdapterRecord, asyncio.Future] = {}  # what a record's waiters await
        self._timer: asyncio.TimerHandle | None = None  # the next time a waiter starts to starve

    def future(self, record: AdapterRecord) -> asyncio.Future:
        """What the requests waiting for ``record`` await (shielded: one
        request leaving does not cancel it for the others)."""
        future = self._futures.get(record)
        if future is None:
            future = self._futures[record] = asyncio.get_running_loop().create_future()
        return future

    def wake(self, record: AdapterRecord, error: BaseException | None = None) -> None:
        """Wake the requests waiting for ``record`` (with ``error``, fail them)."""
        future = self._futures.pop(record, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
            future.add_done_callback(lambda f: f.exception())  # retrieved, even if all left

    def dismiss(self, record: AdapterRecord, error: BaseException | None = None) -> None:
        """Every request waiting for ``record`` stops waiting in line: they are
        woken (with ``error``, failed) and the queue forgets them."""
        self.queue.discard(record)
        self.wake(record, error)

    def admit(self, control: SlotControl) -> None:
        """Give slots to waiting adapters now (mola.registry.admission.admit
        through ``control``), and again when the next waiter starts to starve."""
        if not len(self.queue):
            return
        now = time.monotonic()
        admit(self.queue, control, now, max_yielding=self.max_yielding)
        at = self.queue.next_starving_at(now)
        self.close()
        if at is not None:
            self._timer = asyncio.get_running_loop().call_later(at - now + 1e-3, self.admit, control)

    def describe(self, residents: list[AdapterRecord]) -> dict:
        """Requests waiting for a slot, and how admission has gone."""
        now = time.monotonic()
        waits = [now - self.queue.since(r) for r in self.queue.ordered()]
        return {"max_wait": self.queue.max_wait, "adapters_waiting": len(waits),
                "longest_wait_seconds": max(waits, default=0.0),
                "yielding": sum(r.state is AdapterState.YIELDING for r in residents),
                **vars(self.queue.stats)}

    def close(self) -> None:
        """Stop the timer (a new pass or shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
