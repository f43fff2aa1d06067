"""GET /v1/models and /v1/models/{id}: the base model (parent null) and every
known adapter, resident or not (parent = the base id, root = its path), as
vLLM reports them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import ModelNotFound
from .. import completion_bodies as p
from ..state import ServerState

router = APIRouter()


def _cards(state: ServerState) -> list[dict]:
    cards = [p.model_card(state.base_id, state.created, state.base_root, None, state.max_model_len)]
    for record in state.registry.adapters():
        cards.append(p.model_card(record.name, record.created, record.path, state.base_id, state.max_model_len))
    return cards


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": _cards(request.app.state.mola)}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    for card in _cards(request.app.state.mola):
        if card["id"] == model_id:
            return card
    raise ModelNotFound(model_id, param=None)
