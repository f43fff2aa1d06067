"""OpenAI's chat completions as a dialect: streaming and not, n choices,
tools (forced calls too), response_format, logprobs, and a thinking model's
reasoning (``reasoning_content``)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import Request

from ...errors import MolaError
from ...frontend.generation import Generation, merge
from ...frontend.spec import GenerationSpec, OutputSpec, PromptSpec
from ...frontend.state import ServerState
from .. import completion_bodies as r
from ..errors import error_payload
from ..protocol import ChatCompletionRequest, ChatMessage
from ..streaming import reply, sse, sse_done


def message_dicts(messages: list[ChatMessage], images: bool = True) -> list[dict]:
    """Validated chat messages as the chat template takes them; a user
    message with images has a list of text and image parts for its content
    (with ``images`` False, an image is a 400)."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": m.content_parts(i, images)}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        reasoning = (m.model_extra or {}).get("reasoning_content") or (m.model_extra or {}).get("reasoning")
        if m.role == "assistant" and isinstance(reasoning, str) and reasoning:
            message["reasoning_content"] = reasoning  # what Qwen3's template reads
            message["thinking"] = reasoning  # and gpt-oss's
        out.append(message)
    return out


def to_spec(body: ChatCompletionRequest) -> GenerationSpec:
    body.check_supported()
    prompt = PromptSpec(messages=message_dicts(body.messages), tools=body.tools,
                        parses_tool_calls=body.parses_tool_calls(), options=body.template_options())
    output = OutputSpec(response_format=body.response_format, tools=body.tools, tool_choice=body.tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls)
    return GenerationSpec(body.model, prompt, body.sampling(), output, n=body.n, lora_scale=body.lora_scale,
                          adapters=body.adapter_refs(), tools=body.tools if body.uses_tools() else None)


async def respond(state: ServerState, gens: list[Generation], body: ChatCompletionRequest, request: Request):
    return await reply(request, body.stream, lambda: _stream(state, gens, body, request),
                       lambda: _complete(state, gens, body), lambda: [g.close() for g in gens])


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


def _delta(d, tool_index: dict[int, int]) -> dict:
    """A chunk's delta: reasoning, content, tool calls (numbered per choice)."""
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
    return delta


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
                delta = _delta(d, tool_index)
                if delta or logprobs or d.finish_reason:
                    choice = r.chunk_choice(d.index, delta, d.finish_reason, logprobs)
                    yield chunk([r.with_alora(choice, invoked[d.index]) if d.finish_reason else choice])
        if include_usage:
            yield chunk([], _usage(state, gens))
    except MolaError as e:
        yield sse(error_payload(e))
    yield sse_done()
