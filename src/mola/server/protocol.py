"""OpenAI request bodies as pydantic models, validated strictly (a string is
not a number). Unknown fields are accepted and ignored, as OpenAI clients send
extras; known fields that mola cannot honour are refused with a 400 naming
them (``check_supported``), never silently dropped.

mola's own extensions, beside the standard fields:

- ``lora_scale``: multiplies the adapter that ``model`` names, for this request;
- ``adapters``: ``[{"name" or "path", "scale"}]`` applied together (stacked) to this
  request; an adapter named by path is checked against the adapter directories;
- ``ignore_eos`` (vLLM's): keep generating past EOS, up to max_tokens;
- ``stop_token_ids`` (vLLM's): more token ids that end the output as EOS does
  (also with ``ignore_eos``); the token that ends it is not in the text;
- ``skip_special_tokens`` (vLLM's, default true): special tokens (control tokens,
  EOS) are left out of the text; false renders them.

``response_format`` and ``tool_choice`` are checked and turned into grammars
by :mod:`mola.structured`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import InvalidRequest
from ..frontend.images_in import ImageSource
from ..frontend.spec import SamplingSpec, TemplateOptions
from ..registry.catalog import AdapterRef

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 256
MAX_TEMPLATE_KWARGS_CHARS = 8192  # chat_template_kwargs, as JSON
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values
ReasoningEffort = Literal[REASONING_EFFORTS]


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is not None and len(json.dumps(v)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"chat_template_kwargs takes at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON")
    return v


def forces_tool_call(tool_choice: Any) -> bool:
    """tool_choice "required" or a named function: the output is held to a call."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

    def content_parts(self, index: int, images: bool = True) -> str | list[dict]:
        """The content as one string, or, when a user message carries
        ``image_url`` parts (and ``images``), as a list of text parts and image
        parts ``{"type": "image", "source": ImageSource}`` in their order (the
        pipeline decodes them, mola/frontend/images_in.py). Other media are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            where = f"messages[{index}].content[{j}]"
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and images and self.role == "user":
                parts.append({"type": "image", "source": image_url_source(part, where)})
            elif kind in ("image_url", "input_image", "image", "input_audio", "file"):
                raise InvalidRequest(f"Content parts of type '{kind}' are not supported here: images are taken as "
                                     "'image_url' parts of user messages, on a base that takes images "
                                     "(docs/vision.md).", param=where)
            else:
                raise InvalidRequest(f"Unsupported content part type {kind!r}; only 'text' and 'image_url' parts "
                                     "are supported.", param=where)
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts


def image_url_source(part: dict[str, Any], where: str) -> ImageSource:
    """An ``image_url`` part, ``{"image_url": {"url": ..., "detail": ...}}`` (or
    the URL as a bare string), as an unread ImageSource; ``detail`` is accepted
    and changes nothing (the model's processor sets the resolution)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequest("An image_url part needs 'image_url': {'url': 'data:image/...;base64,...'}.",
                             param=f"{where}.image_url")
    detail = value.get("detail") if isinstance(value, dict) else None
    if detail not in (None, "auto", "low", "high"):
        raise InvalidRequest(f"Unknown image detail {detail!r}; use 'auto', 'low' or 'high'.",
                             param=f"{where}.image_url.detail")
    return ImageSource(param=f"{where}.image_url.url", url=url)


class StreamOptions(_Body):
    include_usage: bool = False


class AdapterWeight(_Body):
    """An entry of ``adapters``: a served adapter by ``name``, or the adapter
    files at ``path`` (checked against the server's adapter directories)."""

    name: str | None = Field(default=None, min_length=1)
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    scale: float = Field(default=1.0, ge=-10.0, le=10.0)

    @model_validator(mode="after")
    def _name_or_path(self):
        if (self.name is None) == (self.path is None):
            raise ValueError("an adapters entry names an adapter by 'name' or by 'path', one of the two")
        return self

    def ref(self) -> AdapterRef:
        return AdapterRef(name=self.name, path=self.path, scale=self.scale)


class _Sampling(_Body):
    """Fields shared by chat and completions (and the Responses API)."""

    PROMPT_PARAM: ClassVar[str] = "prompt"  # the field errors about the prompt name
    MAX_TOKENS_PARAM: ClassVar[str] = "max_tokens"
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    lora_scale: float | None = Field(default=None, ge=-10.0, le=10.0)
    adapters: list[AdapterWeight] | None = Field(default=None, min_length=1, max_length=8)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        items = v if isinstance(v, list) else [v] if v is not None else []
        if len(items) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        for token in v or ():
            if token < 0:
                raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {token}")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self) -> SamplingSpec:
        """How to sample, as this request asks (its dialect's fields, its own checks)."""
        return SamplingSpec(
            max_tokens=self.requested_max_tokens(), temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stop=tuple(self.stop_strings()), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            logit_bias=self.logit_bias, logprobs=self.num_logprobs(), max_tokens_param=self.MAX_TOKENS_PARAM)

    def adapter_refs(self) -> tuple[AdapterRef, ...] | None:
        return tuple(a.ref() for a in self.adapters) if self.adapters else None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def served_model(self) -> str:
        """The ``model`` a response names: the request's, followed by
        ``+path:<path>`` for each adapter it names by path."""
        paths = [a.path for a in self.adapters or () if a.path is not None]
        return "+".join([self.model, *(f"path:{p}" for p in paths)])


class ChatCompletionRequest(_Sampling):
    PROMPT_PARAM: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Variables for the chat template (vLLM's; e.g. {"enable_thinking": false}), and
    # OpenAI's reasoning_effort, handed to templates that read it.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return check_template_kwargs(v)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_options(self) -> TemplateOptions:
        return TemplateOptions(self.chat_template_kwargs, self.reasoning_effort)

    def parses_tool_calls(self) -> bool:
        """Tool calls must be read from free text (tool_choice auto)."""
        return self.uses_tools() and not forces_tool_call(self.tool_choice)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def check_supported(self) -> None:
        if self.tool_choice not in (None, "auto", "none", "required") and not isinstance(self.tool_choice, dict):
            raise InvalidRequest(f"Invalid tool_choice {self.tool_choice!r}.", param="tool_choice")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # as in chat (vLLM accepts it here too)
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("The prompt must not be empty.", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)
        raise InvalidRequest("The prompt must be a string, a list of strings, a list of token "
                             "ids or a list of lists of token ids.", param="prompt")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        if self.echo:
            raise InvalidRequest("'echo' is not supported by this server.", param="echo")
        if self.suffix:
            raise InvalidRequest("'suffix' is not supported by this server.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("'best_of' other than n is not supported by this server.", param="best_of")


MAX_TOKENIZE_CHARS = 1 << 22  # characters /tokenize takes (as well as the request body limit)
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(_Body):
    """POST /tokenize, as vLLM takes it: a ``prompt`` (as /v1/completions
    tokenizes it) or chat ``messages`` (through the chat template, as
    /v1/chat/completions renders them), one of the two."""

    model: str | None = None  # None: the base model (adapters share its tokenizer)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    chat_template: str | None = None  # refused: the model's own template only
    chat_template_kwargs: dict[str, Any] | None = None  # as chat takes them

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return check_template_kwargs(v)

    def template_options(self) -> TemplateOptions:
        return TemplateOptions(self.chat_template_kwargs)

    def chars(self) -> int:
        """About how much text the tokenizer is given."""
        if self.prompt is not None:
            return len(self.prompt)
        total = sum(len(m.content) if isinstance(m.content, str) else
                    sum(len(str(part.get("text") or "")) for part in m.content or ()) for m in self.messages)
        return total + (len(str(self.tools)) if self.tools else 0)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("Give 'prompt' or 'messages', one of the two.",
                                 param="messages" if self.messages is not None else "prompt")
        if self.prompt is not None:
            for field in ("tools", "continue_final_message", "chat_template_kwargs"):
                if getattr(self, field):
                    raise InvalidRequest(f"'{field}' goes with 'messages', not 'prompt'.", param=field)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                                 param="continue_final_message")
        if self.chat_template is not None:
            raise InvalidRequest("'chat_template' is not supported: the model's own chat template is used.",
                                 param="chat_template")
        if self.chars() > MAX_TOKENIZE_CHARS:
            raise InvalidRequest(f"At most {MAX_TOKENIZE_CHARS} characters can be tokenized at once; "
                                 f"this request has {self.chars()}.",
                                 param="prompt" if self.prompt is not None else "messages")


class DetokenizeRequest(_Body):
    """POST /detokenize, as vLLM takes it: token ids in, their text out."""

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v):
        for token in v:
            if token < 0:
                raise ValueError(f"tokens must be token ids (integers >= 0), got {token}")
        return v


# Names are checked against the adapter id grammar by the routes
# (mola/registry/names.py), which say which rule a bad one breaks.


class LoadAdapterRequest(_Body):
    name: str
    path: str = Field(min_length=1)
    scale: float = Field(default=1.0, ge=-10.0, le=10.0)  # multiplies the adapter's own scale
    base: str | None = None  # the base model it goes on (default: the server's default base)


class VLLMLoadLoRARequest(_Body):
    lora_name: str
    lora_path: str = Field(min_length=1)


class VLLMUnloadLoRARequest(_Body):
    lora_name: str
    lora_int_id: int | None = None
