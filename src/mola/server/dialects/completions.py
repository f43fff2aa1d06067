"""OpenAI's completions as a dialect: a prompt (string, strings, token ids,
lists of token ids), streaming and not, n choices per prompt, logprobs,
response_format."""

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
from ..protocol import CompletionRequest
from ..streaming import reply, sse, sse_done


def to_spec(body: CompletionRequest) -> GenerationSpec:
    body.check_supported()
    prompt = PromptSpec(texts=body.prompts(), param="prompt")
    return GenerationSpec(body.model, prompt, body.sampling(),
                          OutputSpec(response_format=body.response_format, reasoning=False), n=body.n,
                          lora_scale=body.lora_scale, adapters=body.adapter_refs())


async def respond(state: ServerState, gens: list[Generation], body: CompletionRequest, request: Request):
    return await reply(request, body.stream, lambda: _stream(state, gens, body, request),
                       lambda: _complete(state, gens, body), lambda: [g.close() for g in gens])


def _usage(gens: list[Generation], n: int) -> dict:
    """Each prompt counted once (with its first choice's cached tokens), every
    choice's tokens."""
    firsts = [g for g in gens if g.index % n == 0]
    return r.usage(sum(g.num_prompt_tokens for g in firsts), sum(g.num_tokens for g in gens),
                   sum(g.num_cached_tokens for g in firsts))


async def _complete(state: ServerState, gens: list[Generation], body: CompletionRequest) -> dict:
    async with contextlib.aclosing(merge(gens)) as deltas:
        async for _ in deltas:
            pass
    token_text = r.TokenText(state.tokenizer) if body.logprobs is not None else None
    choices = []
    for g in sorted(gens, key=lambda g: g.index):
        logprobs = r.completion_logprobs(token_text, g.tokens, g.logprobs, 0) if token_text else None
        choices.append(r.with_alora(r.completion_choice(g.index, g.content, g.finish_reason, logprobs),
                                    g.alora_invoked))
    return r.completion(r.new_id("cmpl"), body.served_model(), r.now(), choices, _usage(gens, body.n))


async def _stream(state: ServerState, gens: list[Generation], body: CompletionRequest,
                  request: Request) -> AsyncIterator[str]:
    id_, created, model = r.new_id("cmpl"), r.now(), body.served_model()
    token_text = r.TokenText(state.tokenizer) if body.logprobs is not None else None
    offsets = {g.index: 0 for g in gens}
    invoked = {g.index: g.alora_invoked for g in gens}
    try:
        async with contextlib.aclosing(merge(gens)) as deltas:
            async for d in deltas:
                if await request.is_disconnected():
                    return
                logprobs = None
                if token_text:
                    logprobs = r.completion_logprobs(token_text, d.tokens, d.logprobs, offsets[d.index])
                offsets[d.index] += len(d.text)
                if d.text or d.finish_reason or logprobs:
                    choice = r.completion_choice(d.index, d.text, d.finish_reason, logprobs)
                    if d.finish_reason:
                        r.with_alora(choice, invoked[d.index])
                    yield sse(r.completion(id_, model, created, [choice], None))
        if body.include_usage():
            yield sse(r.completion(id_, model, created, [], _usage(gens, body.n)))
    except MolaError as e:
        yield sse(error_payload(e))
    yield sse_done()
