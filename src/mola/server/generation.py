"""From a validated request to text: sampling parameters, and one
:class:`Generation` per choice turning engine outputs into deltas (text,
reasoning, tool calls, log-probabilities). Prompts are made in prompts.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from ..adapters.weights import invocation_start
from ..engine.sequence import FinishReason, SamplingParams, Sequence
from ..errors import (ContextLengthExceeded, InvalidRequest, KVBudgetExceeded, MolaError, Overloaded, RequestTimedOut,
                      ShuttingDown)
from ..registry.registry import Lease
from ..structured import CompiledGrammar
from .protocol import _Sampling
from .state import ServerState
from .textstream import TextStream
from .reasoning import Reasoning
from .tools import JsonCallParser, ToolCallParser


class GenerationFailed(MolaError):
    """The engine could not finish a sequence (a failed step, a stopped engine)."""


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


# ---- one choice ----------------------------------------------------------------------


@dataclass
class Delta:
    """What one choice produced in one engine step."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list | None = None  # per token: (logprob, [(id, logprob)])
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""  # the thinking, split off the text (--reasoning-parser)


class Generation:
    """One choice: runs its sequence and yields deltas. Gives its lease on the
    model id back when done, however it ends (``close`` is idempotent). Once
    handed to the engine the sequence is the engine thread's: what this side
    knows of it comes in its outputs."""

    def __init__(self, state: ServerState, seq: Sequence, lease: Lease, stop: list[str],
                 index: int = 0, tools: list[dict] | None = None, model: str = "",
                 skip_special_tokens: bool = True, reasoning: Reasoning | None = None,
                 json_calls=None):
        self.state = state
        self.seq = seq
        self.num_prompt_tokens = seq.num_prompt_tokens
        # Prompt tokens the prompt cache held (each output says; 0 before the first).
        self.num_cached_tokens = 0
        self.lease = lease
        self.index = index
        self.model = model
        self.alora_invoked: bool | None = None  # an activated LoRA's: was its invocation in the prompt
        self._closed = False
        self._start = time.perf_counter()
        self._last: float | None = None  # when the last token arrived
        state.active_sequences += 1
        # Never in the text: the token that ends the output; with skip_special_tokens, any special one.
        # The reasoning parser reads its markers (special or not) and keeps them out of the text.
        special = state.special_token_ids - (reasoning.format.marker_ids if reasoning else frozenset())
        skip = seq.params.stop_token_ids | (special if skip_special_tokens else frozenset())
        self.text = TextStream(state.tokenizer, stop, skip=skip)
        # Reasoning first (harmony's parser reads its calls too), then tool calls in the answer:
        # forced calls in bare JSON (json_calls), or in the family's syntax.
        self.reasoning = reasoning.parser(tools=bool(tools)) if reasoning else None
        if json_calls is not None:
            self.tools = JsonCallParser(json_calls)
        elif tools and getattr(state.tokenizer, "has_tool_calling", False) and not (
                reasoning and reasoning.format.parses_tools):
            self.tools = ToolCallParser(state.tokenizer, tools)
        else:
            self.tools = None
        self.reasoning_text = ""
        self.num_reasoning_tokens = 0  # tokens generated before the thinking ended
        self.content = ""
        self.tool_calls: list[dict] = []
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            async for out in self.state.engine.generate(self.seq):
                self.num_cached_tokens = out.num_cached_tokens
                if out.finish_reason == FinishReason.TIMEOUT:
                    raise RequestTimedOut(
                        f"The request waited longer than --request-timeout "
                        f"({self.state.config.request_timeout:g} s) for the model; try again later."
                    )
                if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    raise GenerationFailed(f"Generation failed: {out.error or out.finish_reason}")
                tokens, logprobs, text = self._add(out.tokens, out.logprobs)
                self._observe(len(tokens))
                self.tokens += tokens
                if logprobs:
                    self.logprobs += logprobs
                finish = "stop" if self.text.stopped else out.finish_reason
                if finish is not None and not self.text.stopped:
                    text += self.text.finish()
                yield self._delta(text, tokens, logprobs, finish)
                if finish is not None:
                    return  # after a stop string, leaving aborts the row
        finally:
            self.close()

    def _add(self, tokens: list[int], logprobs: list | None) -> tuple[list[int], list | None, str]:
        """Text of new tokens, one at a time (a speculative step brings
        several): a stop string ends them at the token that completes it, as
        if they had come one per step."""
        text = self.text.add([]) if not tokens else ""
        for j, t in enumerate(tokens):
            text += self.text.add([t])
            if self.text.stopped:
                return tokens[: j + 1], logprobs[: j + 1] if logprobs else logprobs, text
        return tokens, logprobs, text

    def _delta(self, text, tokens, logprobs, finish) -> Delta:
        calls, reasoning = [], ""
        if self.reasoning is not None:
            was_reasoning = self.reasoning.in_reasoning
            split = self.reasoning.feed(text)
            if finish is not None:
                split += self.reasoning.finish()
            if was_reasoning or self.reasoning.in_reasoning:
                self.num_reasoning_tokens += len(tokens)
            reasoning, text, calls = split.reasoning, split.content, split.calls
            self.reasoning_text += reasoning
        if self.tools is not None:
            text, found = self.tools.feed(text)
            calls = calls + found
            if finish is not None:
                more_text, more_calls = self.tools.finish()
                text, calls = text + more_text, calls + more_calls
        self.content += text
        self.tool_calls += calls
        if finish == "stop" and self.tool_calls:
            finish = "tool_calls"
        self.finish_reason = finish
        return Delta(self.index, text, list(tokens), logprobs, calls, finish, reasoning)

    def _observe(self, n: int) -> None:
        if not n:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self._last is None:
            m.ttft.observe(now - self._start)
        else:
            m.itl.observe(now - self._last)
        self._last = now

    def close(self) -> None:
        """Give the lease back and account for the request (idempotent)."""
        self.lease.release()
        if self._closed:
            return
        self._closed = True
        self.state.active_sequences -= 1
        m = self.state.metrics
        outcome = self.finish_reason or "incomplete"
        m.requests.labels(self.model, outcome).inc()
        m.prompt_tokens.labels(self.model).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(self.model).inc(self.num_tokens)
        m.e2e.observe(time.perf_counter() - self._start)


async def merge(gens: list[Generation]) -> AsyncIterator[Delta]:
    """The deltas of several choices, as they come."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].deltas()) as deltas:
            async for d in deltas:
                yield d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(gen: Generation):
        try:
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    queue.put_nowait(d)
        except BaseException as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            g.close()


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
