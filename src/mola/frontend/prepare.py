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
import dataclasses
import functools
from dataclasses import dataclass

from ..engine.vision_rows import VisionPrompt
from ..errors import InvalidRequest
from ..structured import CompiledGrammar
from .images_in import ImageLimits, check_count, count_images, decode_messages, first_image_param
from .prompts import encode_prompts, render_messages
from .tools import check_tool_support
from .reasoning import Reasoning
from .spec import GenerationSpec, PromptSpec
from .state import ServerState


@dataclass(frozen=True)
class Prepared:
    prompts: list[list[int]]  # token ids, one list per prompt
    grammar: CompiledGrammar | None = None  # what the output must follow (None: free)
    reasoning: Reasoning | None = None  # how the output's thinking is split off (None: it is not)
    vision: VisionPrompt | None = None  # a chat's images, as the vision tower takes them (None: none)


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
    if has_images(state, spec.prompt):
        ids, vision = encode_images(state, spec.prompt)
        return dataclasses.replace(structure(tokenizer, state, spec, [ids]), vision=vision)
    return structure(tokenizer, state, spec, tokenize(tokenizer, state, spec.prompt))


def has_images(state: ServerState, prompt: PromptSpec) -> bool:
    """A chat with images to a vision base (mlx-vlm's processor prepares it)."""
    return state.vision is not None and prompt.messages is not None and count_images(prompt.messages) > 0


def encode_images(state: ServerState, prompt: PromptSpec) -> tuple[list[int], VisionPrompt]:
    """A chat with (decoded) images through mlx-vlm's processor and chat template
    (on the short lane's thread: the processor holds the one tokenizer it uses),
    its tools checked as the text path checks them (prompts.render_messages)."""
    if prompt.tools and prompt.parses_tool_calls and not reads_calls(state):
        check_tool_support(state.prompts.short[0])
    return state.vision.encode(prompt.messages, prompt.tools, prompt.param, state.prompts.limit, prompt.options)


async def with_images(state: ServerState, prompt: PromptSpec, model: str | None = None) -> PromptSpec:
    """``prompt`` with its image parts (``{"type": "image", "source": ImageSource}``)
    decoded into ``{"type": "image", "image": ImageInput}`` on a worker thread,
    off the event loop and off the tokenizer's lanes. First the cheap checks:
    the base takes images (else a 400 naming ``model``), and their count."""
    if prompt.messages is None or not count_images(prompt.messages):
        return prompt
    if not state.takes_images:
        raise InvalidRequest(f"The model '{model or state.base_id}' does not take images: its base "
                             f"'{state.base_id}' is a text-only model. Send text only, or serve a "
                             "vision-language model (docs/vision.md).", param=first_image_param(prompt.messages))
    limits = ImageLimits.of(state.config.vision)
    check_count(prompt.messages, limits, prompt.param)
    messages = await asyncio.to_thread(decode_messages, prompt.messages, limits)
    return dataclasses.replace(prompt, messages=messages)


async def prepare(state: ServerState, spec: GenerationSpec) -> Prepared:
    """Template, tokenize, reasoning and grammar: one trip to the tokenizer
    thread (two for a long prompt that needs reasoning or a grammar)."""
    lanes = state.prompts
    tokenizer, thread = lanes.short if has_images(state, spec.prompt) else await lanes.lane(spec.prompt.chars())
    loop = asyncio.get_running_loop()
    if thread is lanes.short[1]:
        return await loop.run_in_executor(thread, _prepare, tokenizer, state, spec)
    prompts = await loop.run_in_executor(thread, tokenize, tokenizer, state, spec.prompt)
    if not spec.output.may_constrain() and (state.reasoning is None or not spec.output.reasoning):
        return Prepared(prompts)
    short_tokenizer, short = lanes.short
    return await loop.run_in_executor(short, functools.partial(structure, short_tokenizer, state, spec, prompts))


async def prompt_tokens(state: ServerState, prompt: PromptSpec, model: str | None = None) -> list[list[int]]:
    """``prompt`` as token ids alone (count_tokens, for ``model``): its images decoded, then one trip to its
    lane (a vision base's chat with images: the short lane, through mlx-vlm's processor)."""
    prompt = await with_images(state, prompt, model)
    if has_images(state, prompt):
        tokenizer, thread = state.prompts.short
        ids, _ = await asyncio.get_running_loop().run_in_executor(thread, encode_images, state, prompt)
        return [ids]
    return await state.prompts.call(prompt.chars(), tokenize, state, prompt)
