"""POST /v1/chat/completions (dialects/chat.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...frontend.pipeline import start
from ..base_leases import state_for
from ..dialects import chat
from ..protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = await state_for(request, body.model, body.adapters)
    gens = await start(state, chat.to_spec(body))
    return await chat.respond(state, gens, body, request)
