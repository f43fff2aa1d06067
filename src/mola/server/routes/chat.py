"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from ...engine.sequence import Sequence
from ...errors import MolaError
from .. import protocol as p
from ..errors import STATUS, error_body
from ..generation import Generation, render_chat, run_until_disconnect, sampling_params
from ..state import ServerState
from ..streaming import sse, sse_done

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: p.ChatCompletionRequest, request: Request):
    state: ServerState = request.app.state.mola
    body.check_supported()
    lease = await state.registry.acquire(body.model)
    try:
        prompt = render_chat(state.tokenizer, body)
        params = sampling_params(state, body, len(prompt))
        seq = Sequence(prompt=prompt, params=params, slot=lease.slot)
    except BaseException:
        lease.release()
        raise
    gen = Generation(state, seq, lease, body.stop_strings())
    if body.stream:
        return StreamingResponse(
            _stream(gen, body, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(gen.close),
        )
    result = await run_until_disconnect(_complete(gen, body), request)
    return JSONResponse(result) if result is not None else None


async def _complete(gen: Generation, body: p.ChatCompletionRequest) -> dict:
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for _ in deltas:
            pass
    return p.chat_completion(
        id=p.new_id("chatcmpl"),
        model=body.model,
        created=p.now(),
        text=gen.text.text,
        finish_reason=gen.finish_reason,
        prompt_tokens=gen.num_prompt_tokens,
        completion_tokens=gen.num_tokens,
    )


async def _stream(gen: Generation, body: p.ChatCompletionRequest, request: Request) -> AsyncIterator[str]:
    id_, created, model = p.new_id("chatcmpl"), p.now(), body.model
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    def chunk(delta, finish_reason=None):
        return sse({**p.chat_chunk(id_, model, created, delta, finish_reason), **extra})

    try:
        yield chunk({"role": "assistant", "content": ""})
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for text in deltas:
                if await request.is_disconnected():
                    return  # leaving closes `deltas`, which frees the row
                yield chunk({"content": text})
        yield chunk({}, gen.finish_reason)
        if include_usage:
            usage = p.usage(gen.num_prompt_tokens, gen.num_tokens)
            yield sse(p.chat_chunk(id_, model, created, None, usage_=usage))
    except MolaError as e:
        status = next((STATUS[c] for c in type(e).__mro__ if c in STATUS), None)
        type_ = status[1] if status else "server_error"
        yield sse(error_body(e.message, type_, e.param, status[2] if status else None))
    yield sse_done()
