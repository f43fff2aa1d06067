"""mola's adapter routes: list, hot-load and unload while traffic flows.

    GET    /v1/adapters            every adapter with its slot, rank, requests in flight
    POST   /v1/adapters            {"name": ..., "path": ...}
    DELETE /v1/adapters/{name}     stop serving it; its slot frees when in-flight requests end
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import protocol as p
from ..state import ServerState

router = APIRouter()


def _adapter(entry) -> dict:
    return {"id": entry.name, "object": "adapter", **entry.describe()}


@router.get("/v1/adapters")
async def list_adapters(request: Request):
    state: ServerState = request.app.state.mola
    return {
        "object": "list",
        "data": [_adapter(e) for e in state.registry.all_entries()],
        "max_loras": state.registry.max_loras,
        "free_slots": state.registry.num_free_slots,
    }


@router.post("/v1/adapters")
async def load_adapter(body: p.LoadAdapterRequest, request: Request):
    state: ServerState = request.app.state.mola
    entry = await state.registry.load(body.name, body.path)
    return _adapter(entry)


@router.delete("/v1/adapters/{name:path}")
async def unload_adapter(name: str, request: Request):
    state: ServerState = request.app.state.mola
    entry = await state.registry.unload(name)
    return {"id": entry.name, "object": "adapter", "deleted": True, "in_flight": entry.in_flight}
