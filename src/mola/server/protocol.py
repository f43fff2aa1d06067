"""OpenAI request bodies as pydantic models, validated strictly (a string is
not a number), and the response objects as plain dicts shaped by OpenAI's
schemas (components/schemas in OpenAI's openapi.yaml)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import InvalidRequest


class _Body(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI clients send extras;
    # known fields that mola cannot honour are refused in `check_supported`.
    model_config = ConfigDict(extra="allow", strict=True)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The content as one string; image/audio parts are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in ("image_url", "input_image", "image"):
                raise InvalidRequest(
                    "Images are not supported: this server serves text-only models.",
                    param=f"messages[{index}].content[{j}]",
                )
            else:
                raise InvalidRequest(
                    f"Unsupported content part type {kind!r}; only 'text' parts are supported.",
                    param=f"messages[{index}].content[{j}]",
                )
        return "".join(texts)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatCompletionRequest(_Body):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    # vLLM's extension: keep generating past EOS, up to max_tokens (benchmarks).
    ignore_eos: bool = False
    # Known OpenAI fields that this server does not implement yet: refused
    # (with a 400 naming them) unless left at their no-op values.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty strings")
        elif v == "":
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        """Refuse what would otherwise be silently ignored."""
        unsupported = {
            "n": self.n != 1,
            "logprobs": bool(self.logprobs),
            "top_logprobs": bool(self.top_logprobs),
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "response_format": self.response_format not in (None, {"type": "text"}),
            "frequency_penalty": bool(self.frequency_penalty),
            "presence_penalty": bool(self.presence_penalty),
            "logit_bias": bool(self.logit_bias),
        }
        for name, bad in unsupported.items():
            if bad:
                raise InvalidRequest(f"'{name}' is not supported by this server yet.", param=name)


class LoadAdapterRequest(_Body):
    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1)
    scale: float = Field(default=1.0, ge=0.0, le=100.0)  # multiplies the adapter's own scale


class VLLMLoadLoRARequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class VLLMUnloadLoRARequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


# ---- responses (plain dicts, shaped by OpenAI's schemas) -------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_completion(
    id: str, model: str, created: int, text: str, finish_reason: str, prompt_tokens: int,
    completion_tokens: int,
) -> dict:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
    usage_: dict | None = None,
) -> dict:
    chunk = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if delta is not None:
        chunk["choices"] = [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        ]
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def model_card(id: str, created: int, root: str, parent: str | None, max_model_len: int | None) -> dict:
    """A Model object with vLLM's extra fields (root, parent, max_model_len)."""
    return {
        "id": id,
        "object": "model",
        "created": created,
        "owned_by": "mola",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }
