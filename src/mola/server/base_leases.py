"""A request's hold on the bases it is served by: a :class:`BaseLease` from
:meth:`Bases.enter`, kept in the ASGI scope until its response (a stream
too) has been sent."""

from __future__ import annotations

from ..frontend.state import ServerState
from ..bases.control import Bases

LEASES = "mola.base_leases"  # the ASGI scope key listing a request's BaseLeases


class BaseLeases:
    """ASGI middleware: a request's base leases are released once its
    response (a stream too) has been sent."""

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
            for lease in scope.get(LEASES, ()):
                lease.release()


async def state_for(request, model_id: str | None, stack=None) -> ServerState:
    """The state serving ``model_id`` for this request, held until its response ends (see Bases.enter)."""
    names = tuple(a.name for a in stack or () if getattr(a, "name", None))
    lease = await request.app.state.bases.enter(model_id, names)
    request.scope.setdefault(LEASES, []).append(lease)
    return lease.state
