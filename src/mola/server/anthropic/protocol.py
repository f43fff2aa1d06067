"""The bodies of POST /v1/messages and /v1/messages/count_tokens, validated
strictly like chat's (server/protocol.py): unknown fields are accepted and
ignored, known fields that mola cannot honour are refused with a 400 naming
them (``check_supported``).

Beside Anthropic's fields, mola's own apply as in chat (the SDK sends them
through ``extra_body``): ``lora_scale``, ``adapters`` (a stack), and chat's
extensions (``seed``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``chat_template_kwargs``).

Thinking reaches the chat template as chat's ``reasoning_effort`` does:
``thinking: {"type": "disabled"}`` as effort "none" (a template's
enable_thinking off), ``output_config.effort`` as that effort; a template
that cannot take it answers a 400 naming the field (prompts.template_variables).

Content blocks (messages, system, tools) stay dicts here: convert.py checks
each one and names the bad one, as responses_api/items.py does.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from ...errors import InvalidRequest
from ..protocol import TemplateOptions, _Body, _Sampling, check_template_kwargs
from ...frontend.tools import chat_function

MAX_STOP_SEQUENCES = 16  # as chat's stop
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
# Fields that change what Anthropic's API does; mola serves none of them.
REFUSED = {
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported; declare client tools in 'tools'",
    "context_management": "context management (clearing, compaction) is not supported",
    "stop": "on /v1/messages stop strings are 'stop_sequences'",  # chat's name, inherited
}
TOOL_CHOICES = ("auto", "any", "tool", "none")
EFFORTS = ("low", "medium", "high", "xhigh")  # Anthropic's that OpenAI's reasoning_effort has too


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Conversation(_Body):
    """What a prompt is made of: shared by /v1/messages and count_tokens."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # mola's, as in chat

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return check_template_kwargs(v)

    def check_conversation(self) -> None:
        """A 400 naming the first field that mola cannot honour."""
        for name, why in REFUSED.items():
            if getattr(self, name, None) is not None:
                raise InvalidRequest(f"'{name}' is not supported by this server: {why}.", param=name)
        self._check_tools()
        self._check_thinking()
        for key, value in (self.output_config or {}).items():
            if key not in ("format", "effort"):
                raise InvalidRequest(f"output_config.{key} cannot be honoured by this server; only "
                                     "output_config.format and effort are.", param=f"output_config.{key}")
        effort = (self.output_config or {}).get("effort")
        if effort is not None and effort not in EFFORTS:
            raise InvalidRequest(f"output_config.effort {effort!r} cannot be honoured; use one of "
                                 f"{', '.join(EFFORTS)}.", param="output_config.effort")
        if effort is not None and (self.thinking or {}).get("type") == "disabled":
            raise InvalidRequest("output_config.effort asks for thinking that thinking.type 'disabled' "
                                 "turns off; send one of the two.", param="output_config.effort")

    def _check_tools(self) -> None:
        names = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise InvalidRequest(
                    f"Tools of type {kind!r} are not supported: mola runs no server tools (web search, "
                    "code execution, bash, text editor, ...); declare client tools with a name and an "
                    "input_schema.", param=f"tools[{i}].type")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InvalidRequest("A tool needs a 'name' string.", param=f"tools[{i}].name")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise InvalidRequest("A tool needs an 'input_schema' (a JSON schema object).",
                                     param=f"tools[{i}].input_schema")
            if not isinstance(tool.get("description", ""), str):
                raise InvalidRequest("A tool's 'description' must be a string.", param=f"tools[{i}].description")
            names.append(tool["name"])
        choice = self.tool_choice
        if choice is None:
            return
        kind = choice.get("type")
        if kind not in TOOL_CHOICES:
            raise InvalidRequest(f"Invalid tool_choice type {kind!r}; use one of {', '.join(TOOL_CHOICES)}.",
                                 param="tool_choice.type")
        if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
            raise InvalidRequest("tool_choice.disable_parallel_tool_use must be a boolean.",
                                 param="tool_choice.disable_parallel_tool_use")
        if kind in ("any", "tool") and not names:
            raise InvalidRequest(f"tool_choice {kind!r} needs 'tools'.", param="tool_choice")
        if kind == "tool" and choice.get("name") not in names:
            raise InvalidRequest(f"tool_choice names tool {choice.get('name')!r}, which is not among the "
                                 f"tools ({', '.join(names)}).", param="tool_choice.name")

    def _check_thinking(self) -> None:
        kind = (self.thinking or {}).get("type")
        if self.thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
            raise InvalidRequest(f"Invalid thinking type {kind!r}; use 'enabled', 'adaptive' or 'disabled'.",
                                 param="thinking.type")
        if kind == "enabled":
            budget = self.thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
                raise InvalidRequest(f"thinking.budget_tokens must be an integer of at least "
                                     f"{MIN_THINKING_BUDGET}, got {budget!r}.", param="thinking.budget_tokens")

    def uses_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice or {}).get("type") != "none"

    def parses_tool_calls(self) -> bool:
        """Tool calls must be read from free text (tool_choice auto, not forced)."""
        return self.uses_tools() and (self.tool_choice or {}).get("type") not in ("any", "tool")

    def template_options(self) -> TemplateOptions:
        if (self.thinking or {}).get("type") == "disabled":
            return TemplateOptions(self.chat_template_kwargs, "none", "thinking.type")
        effort = (self.output_config or {}).get("effort")
        return TemplateOptions(self.chat_template_kwargs, effort, "output_config.effort")

    def chat_tools(self) -> list[dict] | None:
        """The tools in chat's shape, as chat templates and mlx-lm's tool
        parsers read them (``input_schema`` is the function's ``parameters``)."""
        if not self.tools:
            return None
        return [chat_function(t["name"], t.get("description"), t["input_schema"], t.get("strict"))
                for t in self.tools]

    def chat_tool_choice(self) -> str | dict | None:
        """tool_choice as chat carries it: any -> required, a tool -> a named function."""
        choice = self.tool_choice
        if choice is None:
            return None
        kind = choice["type"]
        if kind == "tool":
            return {"type": "function", "function": {"name": choice["name"]}}
        return {"auto": "auto", "any": "required", "none": "none"}[kind]

    def one_tool_use(self) -> bool:
        """disable_parallel_tool_use: at most one tool_use block (exactly one
        when the call is forced)."""
        return bool((self.tool_choice or {}).get("disable_parallel_tool_use"))

    def response_format(self) -> dict | None:
        """output_config.format as chat's response_format."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise InvalidRequest("output_config.format must be {'type': 'json_schema', 'schema': {...}}.",
                                 param="output_config.format")
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("output_config.format needs a 'schema' object.", param="output_config.format.schema")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


class MessagesRequest(Conversation, _Sampling):
    PROMPT_PARAM: ClassVar[str] = "messages"
    MAX_TOKENS_PARAM: ClassVar[str] = "max_tokens"

    n: Literal[1] = 1  # one message per request
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None  # accepted (user_id), never used
    service_tier: str | None = None  # accepted: one tier here

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v):
        if v is not None:
            if len(v) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(v)}")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty strings")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> list[str]:
        return list(self.stop_sequences or [])

    def num_logprobs(self) -> int | None:
        return None

    def check_supported(self, vocab_size: int) -> None:
        """Checks the conversation, the thinking budget against max_tokens and
        top_k. The engine samples with temperature and top-p only, so top_k
        is served only where it changes nothing or means greedy decoding:
        0 (off), at least the vocabulary (every token), 1 (the most likely
        token: temperature 0). Any other value is a 400."""
        self.check_conversation()
        budget = (self.thinking or {}).get("budget_tokens")
        if (self.thinking or {}).get("type") == "enabled" and budget >= self.max_tokens:
            raise InvalidRequest(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                 f"({self.max_tokens}).", param="thinking.budget_tokens")
        k = self.top_k
        if k == 1:
            self.temperature = 0.0
        elif k not in (None, 0) and k < vocab_size:
            raise InvalidRequest(
                f"top_k {k} cannot be honoured: this server samples with temperature and top_p only. "
                f"Leave top_k out, or send 0 (off), 1 (greedy) or at least the vocabulary size "
                f"({vocab_size}).", param="top_k")


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens: the conversation without sampling."""

    PROMPT_PARAM: ClassVar[str] = "messages"
