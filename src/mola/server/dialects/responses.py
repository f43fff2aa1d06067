"""OpenAI's Responses API as a dialect, streaming as typed events and not.
Its input items (behind those of ``previous_response_id``, from the
server's one store) are rendered as chat messages through the model's
template, tool calls are parsed by the same parser as chat's, and a
ResponseBuilder turns the deltas into output items."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from ...errors import MolaError
from ...frontend.generation import Generation
from ...frontend.spec import GenerationSpec, OutputSpec, PromptSpec
from ..completion_bodies import with_alora
from ..responses_api.events import ResponseBuilder
from ..responses_api.items import check_call_outputs, normalize_input, normalize_item, to_messages
from ..responses_api.objects import request_fields
from ..responses_api.protocol import ResponsesRequest, constrain
from ..responses_api.store import ResponseStore, StoredResponse
from ..streaming import reply, sse_event


@dataclass(frozen=True)
class Conversation:
    """What a response continues: the request, its store, and its whole input
    (the earlier response's items first)."""

    body: ResponsesRequest
    store: ResponseStore
    items: list[dict]


def to_spec(body: ResponsesRequest, store: ResponseStore) -> tuple[GenerationSpec, Conversation]:
    body.check_supported()
    response_format, tool_choice = constrain(body)
    items = normalize_input(body.input)
    earlier = store.get(body.previous_response_id).items if body.previous_response_id is not None else ()
    check_call_outputs(items, earlier)
    items = [*earlier, *items]
    tools = body.chat_tools()
    prompt = PromptSpec(messages=to_messages(items, body.instructions), tools=tools,
                        parses_tool_calls=body.parses_tool_calls(), options=body.template_options(), param="input")
    output = OutputSpec(response_format=response_format, tools=tools, tool_choice=tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls, format_param="text.format")
    spec = GenerationSpec(body.model, prompt, body.sampling(), output, lora_scale=body.lora_scale,
                          adapters=body.adapter_refs(), tools=tools if body.uses_tools() else None)
    return spec, Conversation(body, store, items)


async def respond(gens: list[Generation], talk: Conversation, request: Request):
    gen, = gens
    builder = ResponseBuilder(with_alora(request_fields(talk.body), gen.alora_invoked))
    return await reply(request, talk.body.stream, lambda: _stream(gen, builder, talk, request),
                       lambda: _complete(gen, builder, talk), gen.close)


async def _complete(gen: Generation, builder: ResponseBuilder, talk: Conversation) -> dict:
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for d in deltas:
            builder.add(d.text, d.tool_calls, d.reasoning)
    builder.finish(gen.finish_reason, gen.num_prompt_tokens, gen.num_tokens, gen.num_cached_tokens,
                   gen.num_reasoning_tokens)
    _remember(talk, builder)
    return builder.response


async def _stream(gen: Generation, builder: ResponseBuilder, talk: Conversation,
                  request: Request) -> AsyncIterator[str]:
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
        _remember(talk, builder)
        for event in events:
            yield sse_event(event)
    except MolaError as e:
        for event in builder.fail(e, gen.num_prompt_tokens, gen.num_tokens, gen.num_cached_tokens,
                                  gen.num_reasoning_tokens):
            yield sse_event(event)


def _remember(talk: Conversation, builder: ResponseBuilder) -> None:
    """Keep the response and its conversation for previous_response_id
    (unless store is false); its output items become canonical input items."""
    if not talk.body.stores():
        return
    output = [normalize_item(item, f"output[{i}]") for i, item in enumerate(builder.output)]
    talk.store.put(builder.id, StoredResponse(builder.response, (*talk.items, *output)))
