"""Anthropic's Messages API as a dialect, streaming as Anthropic's events and
not. Its system prompt and messages become chat messages rendered by the
model's template (anthropic/convert.py), tools and tool_choice go through
the same tool-call parser and grammars as chat's, a thinking model's
reasoning becomes thinking blocks, and a MessageBuilder turns the deltas
into content blocks. Errors leave in Anthropic's envelope
(anthropic/errors.py)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import Request

from ...errors import MolaError
from ...frontend.generation import Generation
from ...frontend.spec import GenerationSpec, OutputSpec, PromptSpec
from ...frontend.state import ServerState
from ..anthropic.convert import stop_reason, thinking_text, to_chat_messages
from ..anthropic.errors import stream_error
from ..anthropic.events import MessageBuilder, usage
from ..anthropic.protocol import Conversation, MessagesRequest
from ..completion_bodies import with_alora
from ..streaming import reply, sse_event


def prompt_spec(body: Conversation) -> PromptSpec:
    return PromptSpec(messages=to_chat_messages(body), tools=body.chat_tools(),
                      parses_tool_calls=body.parses_tool_calls(), options=body.template_options())


def to_spec(body: MessagesRequest, vocab_size: int) -> GenerationSpec:
    body.check_supported(vocab_size)
    tools = body.chat_tools()
    output = OutputSpec(response_format=body.response_format(), tools=tools, tool_choice=body.chat_tool_choice(),
                        parallel_tool_calls=False if body.one_tool_use() else None,
                        format_param="output_config.format")
    return GenerationSpec(body.model, prompt_spec(body), body.sampling(), output, lora_scale=body.lora_scale,
                          adapters=body.adapter_refs(), tools=tools if body.uses_tools() else None)


async def respond(state: ServerState, gens: list[Generation], body: MessagesRequest, request: Request):
    gen, = gens
    builder = MessageBuilder(body.served_model())
    with_alora(builder.message, gen.alora_invoked)
    counts_thinking = state.reasoning is not None
    return await reply(request, body.stream, lambda: _stream(gen, builder, body, counts_thinking, request),
                       lambda: _complete(gen, builder, body, counts_thinking), gen.close)


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
