"""Prompts: chat templates and tokenizing, off the event loop, checked against
the context length without tokenizing much more than the context can hold.

- **A character bound first.** No token is longer than the longest one in
  the vocabulary (``max_token_chars``, special tokens included), so a text
  with C characters other than whitespace has at least C / max_token_chars
  tokens: past ``limit * max_token_chars`` it is refused untokenized.
- **Then a bounded prefix.** A longer text is tokenized a prefix at a time
  (cut before whitespace, where tokenizers split words) from about what the
  context holds, growing until the prefix alone holds more than the context
  or the whole text is tokenized. A prefix's tokens differ from the whole
  text's only near the cut, so the prefix must exceed the limit by a slack
  of 3% (at least 32 tokens) before the text is refused: a prompt that fits
  is never refused here; whether it fits with max_tokens is decided exactly
  later (admit.sampling_params).
- **Two lanes.** A Hugging Face fast tokenizer must not be used by two
  threads at once, and one long prompt must not hold up the others: prompts
  of up to LONG_PROMPT_CHARS characters are templated and tokenized on one
  thread with the server's tokenizer, longer ones on another thread with a
  copy of its own, made when the first long prompt comes. (The fast
  tokenizers release the GIL while they encode.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import re
from typing import Callable

from ..errors import ContextLengthExceeded, InvalidRequest
from .spec import TemplateOptions
from .tools import check_tool_support, messages_for_template

log = logging.getLogger("mola.server")

LONG_PROMPT_CHARS = 1 << 15  # longer prompts take the long lane
PROBE_CHARS_PER_TOKEN = 8  # first prefix: this many characters per token of the limit
WHITESPACE = " \t\n\r"
# apply_chat_template's own arguments, which chat_template_kwargs may not set.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def max_token_chars(tokenizer) -> int:
    """Characters of the longest token in the vocabulary (byte-level BPE
    spells each byte as one character, so this bounds what a token covers)."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _too_long(limit: int, what: str, detail: str) -> ContextLengthExceeded:
    return ContextLengthExceeded(
        f"This model's maximum context length is {limit} tokens. However, your {what} "
        f"resulted in more than {limit} tokens ({detail}).", param=what)


def _cut(text: str, size: int) -> int:
    """A prefix length in (size / 2, size] that ends just before whitespace,
    if any lies that near size."""
    lo = max(size // 2 + 1, size - 1024)
    at = max(text.rfind(c, lo, size) for c in WHITESPACE)
    return at if at > 0 else size


def encode_within(encode: Callable[[str], list[int]], text: str, limit: int | None,
                  max_chars: int, what: str, probe_chars: int = PROBE_CHARS_PER_TOKEN) -> list[int]:
    """``encode(text)``, or ContextLengthExceeded as soon as ``text`` surely
    holds more than ``limit`` tokens. A text longer than ``probe_chars`` per
    token of the limit is tokenized a prefix at a time."""
    if limit is None:
        return list(encode(text))
    dense = len(text) - sum(map(text.count, WHITESPACE))
    if dense > limit * max_chars:
        raise _too_long(limit, what, f"at least {-(-dense // max_chars)}: its {dense} characters other "
                        f"than whitespace, and no token is longer than {max_chars}")
    slack = max(32, limit // 32)
    size = (limit + slack) * probe_chars
    while size < len(text):
        cut = _cut(text, size)
        n = len(encode(text[:cut]))
        if n > limit + slack:
            raise _too_long(limit, what, f"{n} in its first {cut} of {len(text)} characters")
        # The next prefix: where this one's density says the limit is, and at least twice as long.
        size = max(2 * size, int(cut * (limit + slack) / max(n, 1) * 1.1))
    return list(encode(text))


def _reads(template: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", template) is not None


def template_variables(tokenizer, options: TemplateOptions | None) -> dict:
    """A request's chat_template_kwargs and reasoning_effort as template
    variables. What the template cannot take, or does not read, is a 400
    naming it (a reasoning_effort of "none" turns a template's
    enable_thinking off, and is a no-op where the template has no thinking)."""
    if options is None:
        return {}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    out = {}
    for key, value in (options.kwargs or {}).items():
        where = f"chat_template_kwargs.{key}"
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequest(f"chat_template_kwargs cannot set {key!r}: the server sets it.", param=where)
        if template is not None and not _reads(template, key):
            raise InvalidRequest(f"This model's chat template does not read {key!r}, so "
                                 f"chat_template_kwargs.{key} would have no effect.", param=where)
        out[key] = value
    effort = options.reasoning_effort
    if effort is None or "reasoning_effort" in out:
        return out
    if template is None or _reads(template, "reasoning_effort"):
        out["reasoning_effort"] = effort
    elif effort == "none" and _reads(template, "enable_thinking"):
        out.setdefault("enable_thinking", False)
    elif effort != "none" or any(m in template for m in ("<think>", "<|channel|>")):
        raise InvalidRequest(
            f"{options.effort_param} {effort!r} cannot be honoured: this model's chat template reads no "
            "reasoning effort" + (" (its thinking is turned off with 'none', or chat_template_kwargs "
                                  "{\"enable_thinking\": false})" if _reads(template, "enable_thinking") else "")
            + ".", param=options.effort_param)
    return out


def render_messages(tokenizer, messages: list[dict], tools: list[dict] | None, uses_tools: bool,
                    param: str, limit: int | None, max_chars: int, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    options: TemplateOptions | None = None) -> list[int]:
    """Chat ``messages`` (and ``tools``, chat's shape) through the tokenizer's
    own chat template, tokenized as mlx-lm and transformers do it: the
    rendered text, encoded without adding special tokens, never more of it
    than the context can hold. ``param`` names the request field they came from.
    (/tokenize may ask for no generation prompt, the last message left open, or
    special tokens added, as vLLM's takes them.) ``uses_tools``: tool calls are
    read from free text (tool_choice auto), which needs the family's parser;
    ``options``: the request's template variables (template_variables)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise InvalidRequest(
            "This model has no chat template; use /v1/completions with a plain prompt.", param=param)
    kwargs = template_variables(tokenizer, options)
    if tools:
        if uses_tools:
            check_tool_support(tokenizer)
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if any(m.get("tool_calls") for m in messages):  # the assistant's calls, as templates expect them
        messages = messages_for_template(messages, tokenizer.chat_template)
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # jinja2 errors raised by templates (role order, ...)
        raise InvalidRequest(f"The chat template rejected the messages: {e}", param=param)
    tokens = encode_within(lambda s: tokenizer.encode(s, add_special_tokens=add_special_tokens), text, limit,
                           max_chars, param)
    if not tokens:
        raise InvalidRequest(f"'{param}' renders to an empty prompt.", param=param)
    return tokens


def encode_prompts(tokenizer, prompts: list[str | list[int]], vocab_size: int, limit: int | None,
                   max_chars: int) -> list[list[int]]:
    """/v1/completions' prompts (strings, or token ids checked against the vocabulary) as token ids."""
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            tokens = encode_within(tokenizer.encode, prompt, limit, max_chars, "prompt")
        else:
            tokens = list(prompt)
        if not tokens:
            raise InvalidRequest(f"Prompt {i} is empty.", param="prompt")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                f"Prompt {i} holds token id {bad[0]}, outside the vocabulary (size {vocab_size}).",
                param="prompt",
            )
        out.append(tokens)
    return out


class PromptLanes:
    """Templating and tokenizing on two threads (see the module's docstring).

    The long lane's copy of the tokenizer (0.1-0.2 s of the GIL for a 49k
    vocabulary) is made when the first long prompt comes, not at the server's
    start: on the short lane's thread, which alone uses the tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, limit: int | None):
        self.vocab_size = vocab_size
        self.limit = limit  # the context length, when known
        self.max_chars = max_token_chars(tokenizer)
        self.short = (tokenizer, self._thread("mola-tokenizer"))
        self._long_thread = self._thread("mola-tokenizer-long")
        self._long_copy: concurrent.futures.Future | None = None  # the copy, once asked for
        self._long: tuple | None = None  # (the copy, its thread), or self.short where it cannot be copied

    @staticmethod
    def _thread(name: str) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def _copy(self) -> concurrent.futures.Future:
        if self._long_copy is None:
            self._long_copy = self.short[1].submit(_copy_or_none, self.short[0])
        return self._long_copy

    def _made(self, copied) -> tuple:
        if self._long is None:
            self._long = (copied, self._long_thread) if copied is not None else self.short
        return self._long

    @property
    def long(self) -> tuple:
        """(tokenizer, thread) of the long lane, its copy made now (waited for) if
        no long prompt has come yet."""
        return self._long or self._made(self._copy().result())

    @long.setter
    def long(self, lane: tuple) -> None:
        self._long = lane

    async def lane(self, chars: int) -> tuple:
        """(tokenizer, thread) for a text of ``chars`` characters."""
        if chars <= LONG_PROMPT_CHARS:
            return self.short
        return self._long or self._made(await asyncio.wrap_future(self._copy()))

    async def call(self, chars: int, fn, *args):
        """``fn(tokenizer, *args)`` on the lane for a text of ``chars`` characters."""
        tokenizer, thread = await self.lane(chars)
        return await asyncio.get_running_loop().run_in_executor(thread, fn, tokenizer, *args)

    async def structured(self, fn, **kwargs):
        """``fn(**kwargs)`` on the short lane, whose thread alone uses the
        server's tokenizer (mola.structured reads it to build llguidance's)."""
        call = functools.partial(fn, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.short[1], call)

    def close(self) -> None:
        for thread in (self.short[1], self._long_thread):
            thread.shutdown(wait=False, cancel_futures=True)


def _copy_or_none(tokenizer):
    """A deep copy of ``tokenizer``, or None (logged) where it cannot be copied."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:  # a tokenizer that cannot be copied: one lane for all
        log.warning("long prompts share the tokenizer thread: the tokenizer cannot be copied (%s)", e)
        return None
