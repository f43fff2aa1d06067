"""mola's adapter routes: list, hot-load and unload while traffic flows.

    GET    /v1/adapters[?base=B]   the default base's (or base B's) adapters: every known adapter: resident or not, slot, rank,
                                   scale, version, requests in flight, last use; stacks
                                   (stacks) and adapters named by path; the host
                                   tier's occupancy and hits; slot admission; and
                                   the prompt cache: size, entries, hits, misses, tokens saved
    POST   /v1/adapters            {"name", "path", "scale"?, "base"?}: check it against that base
                                   (default: the default base) now, serve it
    DELETE /v1/adapters/{name}     stop serving it; its slot frees when in-flight requests end
    PUT    /v1/adapters/{name}/weights[?scale=S&base=B&persist=true]
                                   serve the factors in the body (safetensors, mlx-lm's or PEFT's
                                   names, adapter_config in its metadata) as a new version of name,
                                   from memory (mola.adapters.pushed); persist: also written as an
                                   adapter directory under the first --adapter-dir (a name of one
                                   segment, not starting with '.': what the directory serves)

Names follow the adapter id grammar (mola/registry/names.py); one with '/' is
given in the URL as is or %2F-encoded (the server decodes the path first).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request

from ...adapters import pushed
from ...adapters.loader import prepare_pushed
from ...errors import AdapterExists, InvalidRequest, ModelNotFound
from ...registry.names import check_adapter_id, is_entry_name
from .. import protocol as p
from ..base_leases import state_for
from ...frontend.state import ServerState

router = APIRouter()


def adapter_object(record) -> dict:
    return {"id": record.name, "object": "adapter", **record.describe()}


@router.get("/v1/adapters")
async def list_adapters(request: Request, base: str | None = None):
    state: ServerState = await state_for(request, _base_name(request, base))
    registry = state.registry
    return {
        "object": "list",
        "data": [adapter_object(r) for r in registry.adapters()],
        "stacks": [adapter_object(r) for r in registry.stack_adapters()],
        "path_adapters": [adapter_object(r) for r in registry.path_adapters()],
        "max_loras": registry.max_loras,
        "resident": registry.num_resident,
        "free_slots": registry.num_free_slots,
        "stats": vars(registry.stats),
        "host_tier": registry.tier.describe(),
        "admission": registry.describe_admission(),
        "prompt_cache": state.engine.snapshot.prompt_cache.describe(),
    }


@router.get("/v1/adapters/{name:path}")
async def get_adapter(name: str, request: Request):
    state: ServerState = await state_for(request, name)
    return adapter_object(state.registry.get(name))


@router.post("/v1/adapters")
async def load_adapter(body: p.LoadAdapterRequest, request: Request):
    check_adapter_id(body.name)
    bases = request.app.state.bases
    owner = bases.find(body.name)
    if owner is not None and owner.name != (body.base or bases.default.name):
        raise AdapterExists(body.name)  # a name is one model id, on one base
    state: ServerState = await state_for(request, _base_name(request, body.base))
    record = await state.registry.load(body.name, body.path, body.scale)
    return adapter_object(record)


@router.put("/v1/adapters/{name:path}/weights")
async def push_adapter(name: str, request: Request, scale: float = 1.0, base: str | None = None,
                       persist: bool = False):
    check_adapter_id(name)
    bases = request.app.state.bases
    owner = bases.find(name)
    if owner is not None and owner.name != (base or bases.default.name):
        raise AdapterExists(name)  # a name is one model id, on one base
    if not -10.0 <= scale <= 10.0:
        raise InvalidRequest(f"scale must be in [-10, 10], got {scale}", param="scale")
    if persist and not is_entry_name(name):  # what a restart would not serve is not written
        raise InvalidRequest(f"persist=true writes '{name}' as an entry of --adapter-dir, which serves entries "
                             "named by one segment (no '/') that does not start with '.'; push it under such a "
                             "name, or without persist.", param="name")
    state: ServerState = await state_for(request, _base_name(request, base))
    if state.engine.is_group:
        raise InvalidRequest("A tensor-parallel group reads adapters from files on every rank; it does not "
                             "take pushed weights (POST /v1/adapters a path instead).")
    if persist and not state.config.adapter_dirs:
        raise InvalidRequest("persist=true writes the adapter under the server's first --adapter-dir, and this "
                             "server has none.", param="persist")
    loader, raw = state.registry.loader, await request.body()
    geometry, model_config = loader.geometry, loader.model_config

    def read():  # on the reader thread, in one hop: parse, check against the base, make the slot rows
        body = pushed.parse(name, raw, model_config, state.vocab_size)
        return body, prepare_pushed(body.weights, geometry, scale)

    body, prepared = await loader.on_reader(read)
    persisted = None
    if persist:  # checked against the base first (above): nothing that cannot be served is written
        root = Path(state.config.adapter_dirs[0])
        persisted = await asyncio.to_thread(pushed.persist, name, body, root)
    record = await state.registry.push(name, body.weights, scale, prepared)
    return {**adapter_object(record), **({"persisted": str(persisted)} if persisted else {})}


@router.delete("/v1/adapters/{name:path}")
async def unload_adapter(name: str, request: Request):
    state: ServerState = await state_for(request, name)
    record = await state.registry.unload(name)
    return {"id": record.name, "object": "adapter", "deleted": True, "in_flight": record.in_flight}


def _base_name(request: Request, base: str | None) -> str | None:
    """``base`` if it names a declared base (None: the default one)."""
    if base is not None and base not in request.app.state.bases.by_name:
        raise ModelNotFound(base, param="base")
    return base
