"""From a validated request to its choices: the cheap checks, sampling
parameters, and one :class:`mola.server.choice.Generation` per choice
(which turns engine outputs into deltas). Prompts are made in prompts.py."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from ..adapters.weights import invocation_start
from ..engine.sequence import SamplingParams, Sequence
from ..errors import (ContextLengthExceeded, InvalidRequest, KVBudgetExceeded, Overloaded, RequestTimedOut,
                      ShuttingDown)
from ..registry.registry import Lease
from ..structured import CompiledGrammar
from .protocol import _Sampling
from .state import ServerState
from .choice import Generation
from .reasoning import Reasoning


def sampling_params(state: ServerState, body: _Sampling, num_prompt_tokens: int,
                    choice: int = 0) -> SamplingParams:
    limit = state.max_model_len
    requested = body.requested_max_tokens()
    what = body.PROMPT_PARAM
    if limit is not None:
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{what} resulted in {num_prompt_tokens} tokens.",
                param=what,
            )
        room = limit - num_prompt_tokens
        if requested is not None and requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the {what}, {requested} in the completion). Please reduce the length "
                f"of the {what} or completion.",
                param=body.MAX_TOKENS_PARAM,
            )
        max_tokens = requested if requested is not None else room
    else:
        max_tokens = requested if requested is not None else state.config.default_max_tokens
    budget = state.kv_budget
    if budget is not None and budget.refusal(num_prompt_tokens, max_tokens) is not None:
        if requested is None and budget.max_tokens_for(num_prompt_tokens) >= 1:
            max_tokens = budget.max_tokens_for(num_prompt_tokens)  # what the budget can give it alone
        else:
            raise KVBudgetExceeded(budget.refusal(num_prompt_tokens, max_tokens),
                                   param=body.MAX_TOKENS_PARAM if requested is not None else what)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # Choice i of a seeded request draws with seed + i: reproducible, distinct.
        seed=None if body.seed is None else body.seed + choice,
        # EOS (the model's end-of-generation set, models/eog.py) unless ignored; the request's own ids always.
        stop_token_ids=(frozenset() if body.ignore_eos else frozenset(state.tokenizer.eos_token_ids))
        | body.stop_token_set(state.vocab_size),
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        logit_bias=body.bias_pairs(state.vocab_size),
        logprobs=body.num_logprobs(),
    )


# ---- plumbing shared by the routes ---------------------------------------------------------


def check_constrainable(body: _Sampling, grammar: CompiledGrammar | None) -> None:
    """What a grammar cannot be combined with: a stop string would cut the
    output short of the grammar, and ignore_eos would run past its end."""
    if grammar is None:
        return
    what = grammar.grammar.param
    if body.stop_strings():
        raise InvalidRequest(f"'stop' cannot be combined with {what}: a stop string would cut "
                             "the constrained output before it is complete.", param="stop")
    if body.ignore_eos:
        raise InvalidRequest(f"'ignore_eos' cannot be combined with {what}: the output ends "
                             "where its grammar does.", param="ignore_eos")


async def start_generations(state: ServerState, body: _Sampling, prompts: list[list[int]],
                            tools: list[dict] | None = None,
                            grammar: CompiledGrammar | None = None,
                            reasoning: Reasoning | None = None) -> list[Generation]:
    """One Generation per (prompt, choice), each with its own lease (and,
    under ``grammar``, its own matcher; with ``reasoning``, its own parser
    of the thinking)."""
    check_constrainable(body, grammar)
    accept(state, len(prompts) * body.n)
    stack = [a.ref() for a in body.adapters] if body.adapters else None
    timeout = state.config.request_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    params = [[sampling_params(state, body, len(p), j) for j in range(body.n)] for p in prompts]
    gens: list[Generation] = []
    try:
        for i, prompt in enumerate(prompts):
            for j in range(body.n):
                lease = await _acquire(state, body, stack, deadline)
                invocation = lease.record.invocation_tokens if lease.record is not None else None
                start = invocation_start(invocation, prompt) if invocation else None
                plain = invocation is None or start is not None  # else: not invoked, the base alone
                seq = Sequence(prompt=list(prompt), params=params[i][j], slot=lease.slot if plain else 0,
                               lora_scale=lease.row_scale if plain else 1.0, adapter_key=lease.key if plain else None,
                               deadline=deadline, constraint=grammar.new_constraint() if grammar else None,
                               adapter_start=start)
                gens.append(Generation(state, seq, lease, body.stop_strings(),
                                       index=i * body.n + j, tools=tools, model=body.model,
                                       skip_special_tokens=body.skip_special_tokens, reasoning=reasoning,
                                       json_calls=grammar.grammar.json_calls if grammar else None))
                gens[-1].alora_invoked = None if invocation is None else start is not None
    except BaseException:
        for g in gens:
            g.close()
        raise
    return gens


async def start_reasoning(state: ServerState, prompt: list[int]) -> Reasoning | None:
    """The request's reasoning (None when the server splits none off): whether
    its output starts in the thinking, read from the prompt's end on the
    tokenizer's lane."""
    if state.reasoning is None:
        return None
    return await state.prompts.structured(state.reasoning.start, tokenizer=state.tokenizer, prompt=prompt)


async def _acquire(state: ServerState, body: _Sampling, stack, deadline: float | None) -> Lease:
    """A lease on the request's model id; waiting for an adapter slot counts
    against --request-timeout like waiting in the engine's queue."""
    acquire = state.registry.acquire(body.model, body.lora_scale, stack)
    if deadline is None:
        return await acquire
    try:
        return await asyncio.wait_for(acquire, timeout=max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise RequestTimedOut(
            f"The request waited longer than --request-timeout ({state.config.request_timeout:g} s) "
            "for an adapter slot; try again later."
        ) from None


def accept(state: ServerState, num_sequences: int) -> None:
    """Backpressure: refuse new work while shutting down, or when the queue is full."""
    if state.draining:
        state.metrics.rejected.labels("shutdown").inc()
        raise ShuttingDown("The server is shutting down and takes no new requests.")
    would_queue = state.active_sequences + num_sequences - state.config.engine.max_num_seqs
    if would_queue > state.config.max_queue:
        state.metrics.rejected.labels("queue_full").inc()
        raise Overloaded(
            f"The server is at capacity: {state.active_sequences} sequences are running or "
            f"queued (--max-num-seqs {state.config.engine.max_num_seqs}, --max-queue "
            f"{state.config.max_queue}); retry later.", retry_after=1,
        )


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(coro, request: Request):
    """Await ``coro``; if the client disconnects first, cancel it (which frees
    its batch rows) and return None."""
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
