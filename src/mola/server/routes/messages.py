"""POST /v1/messages (Anthropic's Messages API, dialects/messages.py) and
POST /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import ModelNotFound
from ...frontend.pipeline import start
from ...frontend.prepare import prompt_tokens
from ..anthropic.protocol import CountTokensRequest, MessagesRequest
from ..base_leases import state_for
from ..dialects import messages

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    state = await state_for(request, body.model)
    gens = await start(state, messages.to_spec(body, state.vocab_size))
    return await messages.respond(state, gens, body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt's tokens as /v1/messages would render them (system, messages, tools)."""
    state = await state_for(request, body.model)
    body.check_conversation()
    if body.model != state.base_id and await state.registry.catalog.find(body.model) is None:
        raise ModelNotFound(body.model)
    prompt, = await prompt_tokens(state, messages.prompt_spec(body), body.model)
    return {"input_tokens": len(prompt)}
