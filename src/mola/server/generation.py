"""From a validated request to text: the prompt, the sampling parameters, and
one :class:`Generation` per choice turning engine outputs into text deltas."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from ..engine.sequence import SamplingParams, Sequence
from ..errors import ContextLengthExceeded, InvalidRequest, MolaError
from ..lora.registry import Lease
from .protocol import ChatCompletionRequest
from .state import ServerState
from .textstream import TextStream


class GenerationFailed(MolaError):
    """The engine could not finish a sequence (a failed step, a stopped engine)."""


def render_chat(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The tokenizer's own chat template over the request's messages."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise InvalidRequest(
            "This model has no chat template; use /v1/completions with a plain prompt.",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
    try:
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # jinja2 errors raised by templates (role order, ...)
        raise InvalidRequest(f"The chat template rejected the messages: {e}", param="messages")
    if not tokens:
        raise InvalidRequest("The messages render to an empty prompt.", param="messages")
    return list(tokens)


def sampling_params(
    state: ServerState, body: ChatCompletionRequest, num_prompt_tokens: int
) -> SamplingParams:
    limit = state.max_model_len
    requested = body.requested_max_tokens()
    if limit is not None:
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"messages resulted in {num_prompt_tokens} tokens.",
                param="messages",
            )
        room = limit - num_prompt_tokens
        if requested is not None and requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the messages, {requested} in the completion). Please reduce the length "
                "of the messages or completion.",
                param="max_tokens",
            )
        max_tokens = requested if requested is not None else room
    else:
        max_tokens = requested if requested is not None else state.config.default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop_token_ids=frozenset() if body.ignore_eos else frozenset(state.tokenizer.eos_token_ids),
    )


class Generation:
    """One choice: runs its sequence and yields text deltas. Owns the lease on
    the model id and gives it back when done, however it ends."""

    def __init__(self, state: ServerState, seq: Sequence, lease: Lease, stop: list[str]):
        self.state = state
        self.seq = seq
        self.lease = lease
        self.text = TextStream(state.tokenizer, stop)
        self.finish_reason: str | None = None
        self.num_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    async def deltas(self) -> AsyncIterator[str]:
        eos = self.state.tokenizer.eos_token_ids
        try:
            async for out in self.state.engine.generate(self.seq):
                if out.finish_reason == "error":
                    raise GenerationFailed(f"Generation failed: {out.error}")
                self.num_tokens += len(out.tokens)
                tokens = [t for t in out.tokens if t not in eos]
                delta = self.text.add(tokens)
                if self.text.stopped:  # a stop string: leaving aborts the row
                    self.finish_reason = "stop"
                    if delta:
                        yield delta
                    return
                if out.finish_reason is not None:
                    delta += self.text.finish()
                    self.finish_reason = out.finish_reason
                if delta:
                    yield delta
        finally:
            self.close()

    def close(self) -> None:
        self.lease.release()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(coro, request: Request):
    """Await ``coro``; if the client disconnects first, cancel it (which frees
    its batch row) and return None."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        watch.cancel()
    return work.result() if not work.cancelled() else None
