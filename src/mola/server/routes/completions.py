"""POST /v1/completions (dialects/completions.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...frontend.pipeline import start
from ..base_leases import state_for
from ..dialects import completions
from ..protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    state = await state_for(request, body.model, body.adapters)
    gens = await start(state, completions.to_spec(body))
    return await completions.respond(state, gens, body, request)
