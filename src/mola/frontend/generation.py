"""One choice of a request: a :class:`Generation` runs its sequence on the
engine and turns the engine's outputs into deltas (text, reasoning, tool
calls, log-probabilities); :func:`merge` interleaves several choices'.
Requests are made into generations in pipeline.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..engine.sequence import FinishReason, Sequence
from ..errors import (MolaError, RequestTimedOut)
from ..registry.registry import Lease
from .state import ServerState
from .textstream import TextStream
from .reasoning import Reasoning
from .tools import JsonCallParser, ToolCallParser


class GenerationFailed(MolaError):
    """The engine could not finish a sequence (a failed step, a stopped engine)."""


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
