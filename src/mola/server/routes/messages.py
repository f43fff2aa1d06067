"""POST /v1/messages (Anthropic's Messages API), streaming as Anthropic's
events and not; POST /v1/messages/count_tokens.

A request becomes one Generation over the engine, as a chat completion does:
its system prompt and messages become chat messages rendered by the model's
template (anthropic/convert.py), tools and tool_choice go through the same
tool-call parser and grammars, a thinking model's reasoning is split off by
the same parser (--reasoning-parser) into thinking blocks, and a
MessageBuilder turns the deltas into content blocks. Errors leave in
Anthropic's envelope (anthropic/errors.py).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...errors import ModelNotFound, MolaError
from ..anthropic.convert import stop_reason, thinking_text, to_chat_messages
from ..anthropic.errors import stream_error
from ..anthropic.events import MessageBuilder, usage
from ..anthropic.protocol import Conversation, CountTokensRequest, MessagesRequest
from ..choice import Generation
from ..generation import run_until_disconnect, start_generations, start_reasoning
from ..base_leases import state_for
from ..completion_bodies import with_alora
from ..state import ServerState
from ..streaming import event_stream, sse_event

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    state: ServerState = await state_for(request, body.model)
    body.check_supported(state.vocab_size)
    prompt = await _prompt(state, body)
    tools = body.chat_tools()
    reasoning = await start_reasoning(state, prompt)
    grammar = await state.prompts.structured(
        state.structured.for_request, response_format=body.response_format(), tools=tools,
        tool_choice=body.chat_tool_choice(), parallel_tool_calls=False if body.one_tool_use() else None,
        format_param="output_config.format", thinking=reasoning.grammar if reasoning else None)
    gen, = await start_generations(state, body, [prompt], tools if body.uses_tools() else None, grammar,
                                   reasoning)
    builder = MessageBuilder(body.served_model())
    with_alora(builder.message, gen.alora_invoked)
    counts_thinking = state.reasoning is not None
    if body.stream:
        return event_stream(_stream(gen, builder, body, counts_thinking, request), gen.close)
    result = await run_until_disconnect(_complete(gen, builder, body, counts_thinking), request)
    return JSONResponse(result) if result is not None else None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt's tokens as /v1/messages would render them (system, messages, tools)."""
    state: ServerState = await state_for(request, body.model)
    body.check_conversation()
    if body.model != state.base_id and await state.registry.catalog.find(body.model) is None:
        raise ModelNotFound(body.model)
    return {"input_tokens": len(await _prompt(state, body))}


async def _prompt(state: ServerState, body: Conversation) -> list[int]:
    reads_calls = bool(state.reasoning and state.reasoning.parses_tools)  # harmony's parser reads them
    return await state.prompts.messages(to_chat_messages(body), body.chat_tools(),
                                        body.parses_tool_calls() and not reads_calls, "messages",
                                        options=body.template_options())


async def _deltas(gen: Generation, builder: MessageBuilder, body: MessagesRequest, counts_thinking: bool,
                  request: Request | None = None) -> AsyncIterator[list[dict]]:
    """Events as the generation goes: message_start with the first output
    (when the prompt cache's share of the prompt is known), the blocks, and
    the end. With disable_parallel_tool_use the message ends at its first
    tool_use (leaving the deltas aborts the row). ``counts_thinking``: the
    server splits reasoning off, so usage says how many tokens it took."""
    started = False
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for d in deltas:
            if request is not None and await request.is_disconnected():
                return  # leaving closes the generation, which frees its row
            if not started:
                started = True
                yield builder.start(usage(gen.num_prompt_tokens, 0, gen.num_cached_tokens))
            calls = d.tool_calls[:1] if body.one_tool_use() else d.tool_calls
            yield builder.add(thinking_text(d), d.text, calls)
            if calls and body.one_tool_use():
                break
    if not started:
        yield builder.start(usage(gen.num_prompt_tokens, 0, gen.num_cached_tokens))
    reason, sequence = stop_reason(gen.finish_reason, gen.text.stop_string, builder.num_tool_uses > 0)
    thinking = gen.num_reasoning_tokens if counts_thinking else None
    yield builder.finish(reason, sequence, usage(gen.num_prompt_tokens, gen.num_tokens, gen.num_cached_tokens,
                                                 thinking))


async def _complete(gen: Generation, builder: MessageBuilder, body: MessagesRequest,
                    counts_thinking: bool = False) -> dict:
    async with contextlib.aclosing(_deltas(gen, builder, body, counts_thinking)) as events:
        async for _ in events:
            pass
    return builder.message


async def _stream(gen: Generation, builder: MessageBuilder, body: MessagesRequest, counts_thinking: bool,
                  request: Request) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(_deltas(gen, builder, body, counts_thinking, request)) as events:
            async for batch in events:
                for event in batch:
                    yield sse_event(event)
    except MolaError as e:
        yield sse_event(stream_error(e))
