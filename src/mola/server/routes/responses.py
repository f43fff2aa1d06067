"""POST /v1/responses (OpenAI's Responses API), streaming as typed events and
not; GET /v1/responses/{id} for a stored response.

A request becomes one Generation over the engine, as a chat completion does:
its input items (behind those of ``previous_response_id``) are rendered as
chat messages through the model's template, tool calls are parsed by the
same parser, and a ResponseBuilder turns the deltas into output items.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...errors import MolaError
from ..choice import Generation
from ..generation import run_until_disconnect, start_generations, start_reasoning
from ..responses_api.events import ResponseBuilder
from ..responses_api.items import check_call_outputs, normalize_input, normalize_item, to_messages
from ..responses_api.objects import request_fields
from ..responses_api.protocol import ResponsesRequest, constrain
from ..responses_api.store import ResponseStore, StoredResponse
from ..base_leases import state_for
from ..completion_bodies import with_alora
from ..state import ServerState
from ..streaming import event_stream, sse_event

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: ServerState = await state_for(request, body.model)
    store: ResponseStore = request.app.state.bases.responses  # the server's: any model may continue a response
    body.check_supported()
    response_format, tool_choice = constrain(body)
    items = normalize_input(body.input)
    earlier = store.get(body.previous_response_id).items if body.previous_response_id is not None else ()
    check_call_outputs(items, earlier)
    items = [*earlier, *items]
    tools = body.chat_tools()
    messages = to_messages(items, body.instructions)
    reads_calls = bool(state.reasoning and state.reasoning.parses_tools)  # harmony's parser reads them
    prompt = await state.prompts.messages(messages, tools, body.parses_tool_calls() and not reads_calls, "input",
                                          options=body.template_options())
    reasoning = await start_reasoning(state, prompt)
    grammar = await state.prompts.structured(
        state.structured.for_request, response_format=response_format, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls, format_param="text.format",
        thinking=reasoning.grammar if reasoning else None)
    gen, = await start_generations(state, body, [prompt], tools if body.uses_tools() else None, grammar,
                                   reasoning)
    builder = ResponseBuilder(with_alora(request_fields(body), gen.alora_invoked))
    if body.stream:
        return event_stream(_stream(store, gen, builder, body, items, request), gen.close)
    result = await run_until_disconnect(_complete(store, gen, builder, body, items), request)
    return JSONResponse(result) if result is not None else None


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return JSONResponse(request.app.state.bases.responses.get(response_id, param=None).response)


async def _complete(store: ResponseStore, gen: Generation, builder: ResponseBuilder,
                    body: ResponsesRequest, items: list[dict]) -> dict:
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for d in deltas:
            builder.add(d.text, d.tool_calls, d.reasoning)
    builder.finish(gen.finish_reason, gen.num_prompt_tokens, gen.num_tokens, gen.num_cached_tokens,
                   gen.num_reasoning_tokens)
    _remember(store, body, builder, items)
    return builder.response


async def _stream(store: ResponseStore, gen: Generation, builder: ResponseBuilder, body: ResponsesRequest,
                  items: list[dict], request: Request) -> AsyncIterator[str]:
    try:
        for event in builder.start():
            yield sse_event(event)
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                if await request.is_disconnected():
                    return  # leaving closes the generation, which frees its row
                for event in builder.add(d.text, d.tool_calls, d.reasoning):
                    yield sse_event(event)
        events = builder.finish(gen.finish_reason, gen.num_prompt_tokens, gen.num_tokens,
                                gen.num_cached_tokens, gen.num_reasoning_tokens)
        _remember(store, body, builder, items)
        for event in events:
            yield sse_event(event)
    except MolaError as e:
        for event in builder.fail(e, gen.num_prompt_tokens, gen.num_tokens, gen.num_cached_tokens,
                                  gen.num_reasoning_tokens):
            yield sse_event(event)


def _remember(store: ResponseStore, body: ResponsesRequest, builder: ResponseBuilder,
              items: list[dict]) -> None:
    """Keep the response and its conversation for previous_response_id
    (unless store is false); its output items become canonical input items."""
    if not body.stores():
        return
    output = [normalize_item(item, f"output[{i}]") for i, item in enumerate(builder.output)]
    store.put(builder.id, StoredResponse(builder.response, (*items, *output)))
