"""The Response object and its output items as plain dicts, shaped by
OpenAI's schemas (``Response``, ``OutputMessage``, ``FunctionToolCall``,
``ReasoningItem``, ``ResponseUsage`` in components/schemas of OpenAI's openapi.yaml)."""

from __future__ import annotations

import time
import uuid

from .protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def request_fields(body: ResponsesRequest) -> dict:
    """What a Response repeats of its request, the same in every snapshot."""
    fields = {
        "object": "response",
        "model": body.served_model(),
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": [_tool(t) for t in body.tools or []],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": {"type": "text"}},
        "reasoning": _reasoning(body.reasoning),
        "truncation": "disabled",
        "background": False,
        "store": body.stores(),
        "metadata": dict(body.metadata or {}),
    }
    if body.user is not None:
        fields["user"] = body.user
    return fields


def _reasoning(reasoning: dict | None) -> dict | None:
    if not reasoning or all(v is None for v in reasoning.values()):
        return None
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def _tool(tool: dict) -> dict:
    out = {"type": "function", "name": tool["name"], "parameters": tool.get("parameters"),
           "strict": tool.get("strict")}
    if tool.get("description") is not None:
        out["description"] = tool["description"]
    return out


def response(fields: dict, id: str, created_at: int, status: str, output: list[dict], *,
             usage: dict | None = None, error: dict | None = None,
             incomplete_reason: str | None = None, completed_at: int | None = None) -> dict:
    body = {
        "id": id,
        "created_at": created_at,
        "status": status,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "output": output,
        **fields,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """``cached_tokens``: input tokens served from the prompt cache;
    ``reasoning_tokens``: output tokens spent thinking."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(id: str, status: str, content: list[dict]) -> dict:
    """The model's thinking, whole (no summary, nothing encrypted)."""
    return {"type": "reasoning", "id": id, "status": status, "summary": [], "content": content,
            "encrypted_content": None}


def message_item(id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": id, "status": status, "role": "assistant", "content": content}


def function_call_item(id: str, call: dict, status: str, arguments: str | None = None) -> dict:
    """``call``: one of the tool parser's calls (chat's ``tool_calls`` shape)."""
    fn = call["function"]
    return {"type": "function_call", "id": id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments, "status": status}
