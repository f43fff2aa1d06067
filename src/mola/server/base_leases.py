"""A request's hold on the bases it is served by: counted in flight from
:meth:`Bases.enter` until its response (a stream too) has been sent."""

from __future__ import annotations

from .bases import LEASES, Bases
from ..frontend.state import ServerState


class BaseLeases:
    """ASGI middleware: a request stays in flight on the bases it entered
    until its response (a stream too) has been sent."""

    def __init__(self, app, bases: Bases):
        self.app = app
        self.bases = bases

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[LEASES] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for base in scope.get(LEASES, ()):
                self.bases.leave(base)


async def state_for(request, model_id: str | None, stack=None) -> ServerState:
    """The state serving ``model_id`` for this request (see Bases.enter)."""
    names = tuple(a.name for a in stack or () if getattr(a, "name", None))
    return await request.app.state.bases.enter(model_id, request.scope, names)
