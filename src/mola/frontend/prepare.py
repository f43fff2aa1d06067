"""The request's one trip to the tokenizer thread: its prompts templated and
tokenized, whether its output starts in the thinking, and the grammar it
must follow, compiled. Everything here runs on the thread of the prompt's
lane (prompts.py).

A prompt longer than the short lane takes is templated on the long lane,
with that lane's copy of the tokenizer; its reasoning and grammar then take
a second trip to the short lane, whose thread alone uses the server's
tokenizer (mola.structured reads it), when the request needs either."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from ..structured import CompiledGrammar
from .prompts import encode_prompts, render_messages
from .reasoning import Reasoning
from .spec import GenerationSpec, PromptSpec
from .state import ServerState


@dataclass(frozen=True)
class Prepared:
    prompts: list[list[int]]  # token ids, one list per prompt
    grammar: CompiledGrammar | None = None  # what the output must follow (None: free)
    reasoning: Reasoning | None = None  # how the output's thinking is split off (None: it is not)


def reads_calls(state: ServerState) -> bool:
    """The server's reasoning parser reads this model's tool calls itself (harmony's)."""
    return bool(state.reasoning and state.reasoning.parses_tools)


def tokenize(tokenizer, state: ServerState, prompt: PromptSpec) -> list[list[int]]:
    """``prompt`` as token ids (on a tokenizer thread, with its lane's tokenizer)."""
    lanes = state.prompts
    if prompt.texts is not None:
        return encode_prompts(tokenizer, prompt.texts, lanes.vocab_size, lanes.limit, lanes.max_chars)
    uses_tools = prompt.parses_tool_calls and not reads_calls(state)
    return [render_messages(tokenizer, prompt.messages, prompt.tools, uses_tools, prompt.param, lanes.limit,
                            lanes.max_chars, options=prompt.options)]


def structure(tokenizer, state: ServerState, spec: GenerationSpec, prompts: list[list[int]]) -> Prepared:
    """The reasoning and grammar of a request whose prompts are ``prompts``
    (on the short lane's thread)."""
    reasoning = None
    if state.reasoning is not None and spec.output.reasoning:
        reasoning = state.reasoning.start(tokenizer, prompts[0])
    out = spec.output
    grammar = None
    if out.may_constrain() or reasoning is not None:
        grammar = state.structured.for_request(
            response_format=out.response_format, tools=out.tools, tool_choice=out.tool_choice,
            parallel_tool_calls=out.parallel_tool_calls, format_param=out.format_param,
            thinking=reasoning.grammar if reasoning else None)
    return Prepared(prompts, grammar, reasoning)


def _prepare(tokenizer, state: ServerState, spec: GenerationSpec) -> Prepared:
    return structure(tokenizer, state, spec, tokenize(tokenizer, state, spec.prompt))


async def prepare(state: ServerState, spec: GenerationSpec) -> Prepared:
    """Template, tokenize, reasoning and grammar: one trip to the tokenizer
    thread (two for a long prompt that needs reasoning or a grammar)."""
    lanes = state.prompts
    tokenizer, thread = await lanes.lane(spec.prompt.chars())
    loop = asyncio.get_running_loop()
    if thread is lanes.short[1]:
        return await loop.run_in_executor(thread, _prepare, tokenizer, state, spec)
    prompts = await loop.run_in_executor(thread, tokenize, tokenizer, state, spec.prompt)
    if not spec.output.may_constrain() and (state.reasoning is None or not spec.output.reasoning):
        return Prepared(prompts)
    short_tokenizer, short = lanes.short
    return await loop.run_in_executor(short, functools.partial(structure, short_tokenizer, state, spec, prompts))


async def prompt_tokens(state: ServerState, prompt: PromptSpec) -> list[list[int]]:
    """``prompt`` as token ids alone (count_tokens): one trip to its lane."""
    return await state.prompts.call(prompt.chars(), tokenize, state, prompt)
