"""A request's hold on the base serving it (:class:`BaseLease`, from
:meth:`mola.bases.control.Bases.enter`)."""

from __future__ import annotations

from typing import Callable

from ..frontend.state import ServerState
from .record import Base


class BaseLease:
    """A request's hold on the base serving it (from :meth:`Bases.enter`):
    while held, the base counts the request in flight and is never unloaded.
    Not a slot's :class:`mola.registry.registry.Lease`, which the pipeline
    takes on an adapter slot of that base."""

    def __init__(self, base: Base, leave: Callable[[Base], None]):
        self.base = base
        self.leave = leave  # Bases.leave: the request no longer counts in flight
        self.released = False

    @property
    def state(self) -> ServerState:
        return self.base.state

    def release(self) -> None:
        """Idempotent."""
        if not self.released:
            self.released = True
            self.leave(self.base)
