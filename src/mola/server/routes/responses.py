"""POST /v1/responses (OpenAI's Responses API, dialects/responses.py) and
GET /v1/responses/{id} for a stored response."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...frontend.pipeline import start
from ..base_leases import state_for
from ..dialects import responses
from ..responses_api.protocol import ResponsesRequest

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state = await state_for(request, body.model)
    # The server's store: any model may continue a response, and it outlives a base's unload.
    spec, conversation = responses.to_spec(body, request.app.state.responses)
    gens = await start(state, spec)
    return await responses.respond(gens, conversation, request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return JSONResponse(request.app.state.responses.get(response_id, param=None).response)
