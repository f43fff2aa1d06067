"""The body of POST /v1/responses, validated strictly like chat's
(server/protocol.py): unknown fields are accepted and ignored, known fields
mola cannot honour are refused with a 400 naming them (``check_supported``),
and everything that needs constrained decoding passes through one hook,
:func:`constrain`.

Beside OpenAI's fields, mola's own apply as in chat: ``lora_scale``,
``adapters`` (a stack), and chat's sampling extensions (``seed``, ``stop``,
``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from ...errors import InvalidRequest
from ..protocol import REASONING_EFFORTS, TemplateOptions, _Sampling, check_template_kwargs, forces_tool_call
from ...frontend.tools import chat_function

# `include` values that ask for items mola never produces (built-in tool
# calls, encrypted reasoning, input images): accepted, they add nothing.
VACUOUS_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content",
})
# Fields that change what OpenAI's API does; mola serves none of them.
REFUSED = {
    "prompt": "prompt templates are not supported; send the text as 'input'",
    "conversation": "the Conversations API is not served; use 'previous_response_id' or send the items",
    "context_management": "context management (compaction) is not supported",
    "moderation": "moderation is not supported",
}


class ResponsesRequest(_Sampling):
    PROMPT_PARAM: ClassVar[str] = "input"
    MAX_TOKENS_PARAM: ClassVar[str] = "max_output_tokens"

    n: Literal[1] = 1  # one output per response
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    store: bool | None = None  # None: true, as in OpenAI's API
    metadata: dict[str, str] | None = None  # accepted and returned
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    background: bool | None = None
    reasoning: dict[str, Any] | None = None  # effort goes to the chat template (as chat's reasoning_effort)
    chat_template_kwargs: dict[str, Any] | None = None  # as in chat
    truncation: str | None = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
    moderation: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return check_template_kwargs(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None:
            if len(v) > 16:
                raise ValueError(f"at most 16 metadata pairs, got {len(v)}")
            for key, value in v.items():
                if len(key) > 64 or len(value) > 512:
                    raise ValueError(f"metadata key {key[:64]!r}: keys take at most 64 characters, "
                                     "values at most 512")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def num_logprobs(self) -> int | None:
        return None

    def stores(self) -> bool:
        return self.store is not False

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def parses_tool_calls(self) -> bool:
        """Tool calls must be read from free text (tool_choice auto)."""
        return self.uses_tools() and not forces_tool_call(self.tool_choice)

    def check_supported(self) -> None:
        """A 400 naming the first field that mola cannot honour."""
        for name, why in REFUSED.items():
            if getattr(self, name) is not None:
                raise InvalidRequest(f"'{name}' is not supported by this server: {why}.", param=name)
        if self.background:
            raise InvalidRequest("'background' responses are not supported by this server; "
                                 "stream the response instead.", param="background")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequest(f"truncation {self.truncation!r} is not supported; an input longer "
                                 "than the context is a 400 ('disabled').", param="truncation")
        self._check_reasoning()
        self._check_include()
        verbosity = (self.text or {}).get("verbosity")
        if verbosity not in (None, "medium"):
            raise InvalidRequest(f"text.verbosity {verbosity!r} cannot be honoured by this server.",
                                 param="text.verbosity")
        self._check_tools()

    def _check_reasoning(self) -> None:
        """effort is handed to the chat template (which may refuse it); the
        reasoning comes back whole, so a summary can be "auto" (the server's
        choice: none) but not "concise" or "detailed"."""
        for key, value in (self.reasoning or {}).items():
            if value is None:
                continue
            if key == "effort":
                if value not in REASONING_EFFORTS:
                    raise InvalidRequest(f"Invalid reasoning.effort {value!r}; use one of "
                                         f"{', '.join(REASONING_EFFORTS)}.", param="reasoning.effort")
            elif key in ("summary", "generate_summary") and value == "auto":
                pass
            else:
                raise InvalidRequest(f"reasoning.{key} {value!r} cannot be honoured: this server returns "
                                     "the model's reasoning as it is, not summarised.", param=f"reasoning.{key}")

    def template_options(self) -> TemplateOptions:
        effort = (self.reasoning or {}).get("effort")
        return TemplateOptions(self.chat_template_kwargs, effort, "reasoning.effort")

    def _check_include(self) -> None:
        if self.top_logprobs:
            raise InvalidRequest("Log-probabilities are not supported on /v1/responses; use "
                                 "/v1/chat/completions with 'logprobs'.", param="top_logprobs")
        for i, value in enumerate(self.include or []):
            if value == "message.output_text.logprobs":
                raise InvalidRequest("Log-probabilities are not supported on /v1/responses; use "
                                     "/v1/chat/completions with 'logprobs'.", param=f"include[{i}]")
            if value not in VACUOUS_INCLUDES:
                raise InvalidRequest(f"Unknown include value {value!r}.", param=f"include[{i}]")

    def _check_tools(self) -> None:
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise InvalidRequest(
                    f"Tools of type {kind!r} are not supported: mola runs no built-in tools "
                    "(web search, file search, code interpreter, MCP, ...); declare function tools.",
                    param=f"tools[{i}].type")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InvalidRequest("A function tool needs a 'name' string.", param=f"tools[{i}].name")
            if not isinstance(tool.get("parameters"), (dict, type(None))):
                raise InvalidRequest("A function tool's 'parameters' must be a JSON schema object.",
                                     param=f"tools[{i}].parameters")
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"Invalid tool_choice {choice!r}.", param="tool_choice")
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise InvalidRequest(f"tool_choice of type {choice.get('type')!r} is not supported; "
                                     "use 'auto', 'none', 'required' or a function.", param="tool_choice")
            names = [t["name"] for t in self.tools or []]
            if choice.get("name") not in names:
                raise InvalidRequest(f"tool_choice names function {choice.get('name')!r}, which is "
                                     f"not among the tools ({', '.join(names) or 'none given'}).",
                                     param="tool_choice.name")

    def chat_tools(self) -> list[dict] | None:
        """The function tools in chat's shape, as chat templates and mlx-lm's
        tool parsers read them."""
        if not self.tools:
            return None
        return [chat_function(t["name"], t.get("description"), t.get("parameters")) for t in self.tools]

    def chat_equivalents(self) -> tuple[dict | None, str | dict | None]:
        """(response_format, tool_choice) as a chat completion would carry them."""
        fmt = (self.text or {}).get("format")
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if fmt is None or kind == "text":
            response_format = None
        elif kind == "json_object":
            response_format = {"type": "json_object"}
        elif kind == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            response_format = {"type": "json_schema", "json_schema": spec}
        else:
            raise InvalidRequest(f"Unknown text.format type {kind!r}; use 'text', 'json_object' or "
                                 "'json_schema'.", param="text.format.type")
        choice = self.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return response_format, choice


def constrain(body: ResponsesRequest) -> tuple[dict | None, str | dict | None]:
    """The hook for constrained decoding on /v1/responses: (response_format,
    tool_choice) in chat's shapes, which the route hands to
    mola.structured (``text.format`` json_object / json_schema, ``tool_choice``
    "required" or a named function). ``parallel_tool_calls: false`` is
    honoured only where calls are forced (the grammar allows one); under
    "auto" nothing could hold the model to one call, so it is refused."""
    response_format, tool_choice = body.chat_equivalents()
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if body.parallel_tool_calls is False and body.uses_tools() and not forced:
        raise InvalidRequest(
            "parallel_tool_calls: false is honoured only with tool_choice 'required' or a named "
            "function (mola constrains the number of calls only when it forces them); leave it out, "
            "set it to true, or force the call.", param="parallel_tool_calls")
    return response_format, tool_choice
