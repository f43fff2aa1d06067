"""What a request asks for, in no dialect and with no HTTP in it: a
:class:`GenerationSpec` (what to generate, for whom, with which adapter and
sampling). Each dialect of the server turns its body into one (its
``to_spec``); the pipeline (pipeline.py) serves every spec the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..registry.catalog import AdapterRef


@dataclass(frozen=True)
class TemplateOptions:
    """What a request adds to its chat template's variables: its
    ``chat_template_kwargs`` and ``reasoning_effort`` (``effort_param``: the
    field that carried it), checked against the template in prompts.py."""

    kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    effort_param: str = "reasoning_effort"


@dataclass(frozen=True)
class PromptSpec:
    """What the model reads: chat-shaped ``messages`` through the model's chat
    template, or raw ``texts`` (strings or token ids, one prompt each)."""

    messages: list[dict] | None = None
    texts: list[str | list[int]] | None = None
    tools: list[dict] | None = None  # handed to the chat template (chat's shape)
    parses_tool_calls: bool = False  # tool calls are read from free text (tool_choice auto)
    options: TemplateOptions | None = None
    param: str = "messages"  # the request field errors about the prompt name

    def chars(self) -> int:
        """About how much the tokenizer is given (it picks the prompt's lane)."""
        if self.texts is not None:
            return sum(len(t) for t in self.texts)
        text = sum(_content_chars(m.get("content")) + len(str(m.get("tool_calls") or "")) for m in self.messages)
        return text + (len(str(self.tools)) if self.tools else 0)


def _content_chars(content) -> int:
    """Characters of a message's content: a string, or its parts' text (an image part counts none)."""
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return len(str(content or ""))


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample, as the request asks (checked by admit.py)."""

    max_tokens: int | None = None  # requested (None: what the context leaves)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    logprobs: int | None = None  # top alternatives per token (None: no log-probabilities)
    max_tokens_param: str = "max_tokens"  # the request field that carried max_tokens


@dataclass(frozen=True)
class OutputSpec:
    """What the output must follow (a grammar, when anything here asks for
    one) and whether the model's thinking is split off."""

    response_format: Any = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    format_param: str = "response_format"
    reasoning: bool = True  # split a thinking model's reasoning off (--reasoning-parser)

    def may_constrain(self) -> bool:
        """Whether a grammar may come of it (then the grammar is compiled)."""
        return bool(self.response_format or self.tools or self.tool_choice)


@dataclass(frozen=True)
class GenerationSpec:
    """One request: ``n`` choices of each prompt, by ``model`` (a base or an
    adapter id) scaled by ``lora_scale``, or with ``adapters`` stacked."""

    model: str
    prompt: PromptSpec
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    n: int = 1
    lora_scale: float | None = None
    adapters: tuple[AdapterRef, ...] | None = None
    tools: list[dict] | None = None  # what tool calls are parsed against (None: none are)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt.texts) if self.prompt.texts is not None else 1
