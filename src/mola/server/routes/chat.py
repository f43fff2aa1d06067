"""POST /v1/chat/completions, streaming and not, n choices, tools (forced
calls too), response_format, logprobs, and a thinking model's reasoning
(``reasoning_content``)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...errors import MolaError
from .. import completion_bodies as r
from ..errors import error_payload
from ..choice import Generation, merge
from ..generation import run_until_disconnect, start_generations, start_reasoning
from ..protocol import ChatCompletionRequest
from ..base_leases import state_for
from ..state import ServerState
from ..streaming import event_stream, sse, sse_done

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state: ServerState = await state_for(request, body.model, body.adapters)
    body.check_supported()
    # Templating and tokenizing a long prompt takes a while: off the event loop.
    prompt = await state.prompts.chat(body, reads_calls=bool(state.reasoning and state.reasoning.parses_tools))
    tools = body.tools if body.uses_tools() else None
    reasoning = await start_reasoning(state, prompt)
    grammar = await state.prompts.structured(
        state.structured.for_request, response_format=body.response_format, tools=body.tools,
        tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        thinking=reasoning.grammar if reasoning else None)
    gens = await start_generations(state, body, [prompt], tools, grammar, reasoning)
    if body.stream:
        return event_stream(_stream(state, gens, body, request), lambda: [g.close() for g in gens])
    result = await run_until_disconnect(_complete(state, gens, body), request)
    return JSONResponse(result) if result is not None else None


def _usage(state: ServerState, gens: list[Generation]) -> dict:
    """One prompt for every choice: counted once, with the first choice's cached tokens."""
    thinking = sum(g.num_reasoning_tokens for g in gens) if state.reasoning else None
    return r.usage(gens[0].num_prompt_tokens, sum(g.num_tokens for g in gens), gens[0].num_cached_tokens,
                   thinking)


async def _complete(state: ServerState, gens: list[Generation], body: ChatCompletionRequest) -> dict:
    async with contextlib.aclosing(merge(gens)) as deltas:
        async for _ in deltas:
            pass
    token_text = r.TokenText(state.tokenizer) if body.logprobs else None
    choices = []
    for g in gens:
        content = g.content if (g.content.strip() or not g.tool_calls) else None
        logprobs = r.chat_logprobs(token_text, g.tokens, g.logprobs) if token_text else None
        message = r.chat_message(content, g.tool_calls, g.reasoning_text, state.reasoning is not None)
        choices.append(r.with_alora(r.chat_choice(g.index, message, g.finish_reason, logprobs), g.alora_invoked))
    return r.chat_completion(r.new_id("chatcmpl"), body.served_model(), r.now(), choices, _usage(state, gens))


async def _stream(state: ServerState, gens: list[Generation], body: ChatCompletionRequest,
                  request: Request) -> AsyncIterator[str]:
    id_, created, model = r.new_id("chatcmpl"), r.now(), body.served_model()
    include_usage = body.include_usage()
    token_text = r.TokenText(state.tokenizer) if body.logprobs else None
    tool_index = {g.index: 0 for g in gens}
    invoked = {g.index: g.alora_invoked for g in gens}

    def chunk(choices, usage=None):
        return sse(r.chat_chunk(id_, model, created, choices, usage, include_usage))

    try:
        for g in gens:
            yield chunk([r.chunk_choice(g.index, {"role": "assistant", "content": ""})])
        async with contextlib.aclosing(merge(gens)) as deltas:
            async for d in deltas:
                if await request.is_disconnected():
                    return  # leaving closes the generations, which frees their rows
                logprobs = r.chat_logprobs(token_text, d.tokens, d.logprobs) if token_text else None
                delta = {}
                if d.reasoning:
                    delta["reasoning_content"] = d.reasoning
                if d.text:
                    delta["content"] = d.text
                if d.tool_calls:
                    calls = []
                    for call in d.tool_calls:
                        calls.append({"index": tool_index[d.index], **call})
                        tool_index[d.index] += 1
                    delta["tool_calls"] = calls
                if delta or logprobs or d.finish_reason:
                    choice = r.chunk_choice(d.index, delta, d.finish_reason, logprobs)
                    yield chunk([r.with_alora(choice, invoked[d.index]) if d.finish_reason else choice])
        if include_usage:
            yield chunk([], _usage(state, gens))
    except MolaError as e:
        yield sse(error_payload(e))
    yield sse_done()
