"""Input items, checked and made canonical, and the chat messages they stand
for (what the model's chat template renders).

Canonical items, the only shapes stored and rendered:

    {"type": "message", "role": "user"|"assistant"|"system"|"developer", "content": str}
    {"type": "message", "role": "user", "content": [text and image parts, as chat's]}
    {"type": "function_call", "call_id": str, "name": str, "arguments": str}
    {"type": "function_call_output", "call_id": str, "output": str}
    {"type": "reasoning", "content": str}

A response's own output items are valid input items, so a client that sends
them back and a ``previous_response_id`` that replays them give the same
canonical items, hence the same prompt.
"""

from __future__ import annotations

from ...errors import InvalidRequest
from ...frontend.images_in import ImageSource

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
MEDIA_PARTS = ("input_file", "input_audio")
DETAILS = (None, "auto", "low", "high")


def normalize_input(value: str | list[dict], param: str = "input") -> list[dict]:
    """Canonical items of a request's ``input``; a 400 names the bad part."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not value:
        raise InvalidRequest("'input' must be a string or a non-empty list of items.", param=param)
    return [normalize_item(item, f"{param}[{i}]") for i, item in enumerate(value)]


def normalize_item(item: dict, where: str) -> dict:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"Invalid role {role!r}; use one of {', '.join(ROLES)}.",
                                 param=f"{where}.role")
        content = item.get("content")
        if role == "user" and isinstance(content, list):
            return {"type": "message", "role": role, "content": _parts(content, f"{where}.content")}
        return {"type": "message", "role": role, "content": _text(content, f"{where}.content")}
    if kind == "function_call":
        return {"type": "function_call", "call_id": _string(item, "call_id", where),
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": _string(item, "call_id", where),
                "output": _text(item.get("output"), f"{where}.output")}
    if kind == "reasoning":  # the text of its reasoning_text parts (else its summary's)
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise InvalidRequest("A reasoning item's 'content' must be a list of reasoning_text parts.",
                                 param=f"{where}.content")
        return {"type": "reasoning", "content": "".join(p["text"] for p in parts)}
    if kind == "item_reference":
        raise InvalidRequest("Item references are not supported; send the item itself, or use "
                             "'previous_response_id'.", param=f"{where}.type")
    raise InvalidRequest(f"Input items of type {kind!r} are not supported: mola takes message, "
                         "function_call, function_call_output and reasoning items.", param=f"{where}.type")


def check_call_outputs(items: list[dict], earlier: tuple[dict, ...] = (), param: str = "input") -> None:
    """A 400, as OpenAI's, for a function_call_output in ``items`` whose call_id
    answers no function_call before it (in ``earlier``, a stored conversation,
    or in ``items``)."""
    called = {i["call_id"] for i in earlier if i["type"] == "function_call"}
    for j, item in enumerate(items):
        if item["type"] == "function_call":
            called.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in called:
            raise InvalidRequest(f"No tool call found for function call output with call_id {item['call_id']!r}: "
                                 "send the function_call item before its output (or continue the response "
                                 "that made the call with previous_response_id).", param=f"{param}[{j}].call_id")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise InvalidRequest(f"'{key}' must be a non-empty string, got {value!r}.", param=f"{where}.{key}")
    return value


def _text(content, where: str) -> str:
    """A string, or the text of a list of text parts; media are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Expected a string or a list of content parts, got {content!r}.", param=where)
    return "".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


def _part_text(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = TEXT_PARTS.get(kind)
    if key is not None and isinstance(part.get(key), str):
        return part[key]
    if kind == "input_image":
        raise InvalidRequest("Images are taken in user messages only, on a base that takes images "
                             "(docs/vision.md).", param=where)
    if kind in MEDIA_PARTS:
        raise InvalidRequest(f"Content parts of type {kind!r} are not supported: mola takes text, and "
                             "images as 'input_image' parts.", param=where)
    raise InvalidRequest(f"Unsupported content part {kind!r}; use 'input_text' (or "
                         "'output_text' for earlier answers).", param=where)


def _parts(content: list, where: str) -> str | list[dict]:
    """A user message's parts: its text alone, or (with ``input_image``
    parts) text parts and image parts ``{"type": "image", "source":
    ImageSource}`` in their order, as chat's (the pipeline decodes them,
    mola/frontend/images_in.py)."""
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append({"type": "image", "source": _image_source(part, f"{where}[{j}]")})
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{where}[{j}]")})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_source(part: dict, where: str) -> ImageSource:
    """An ``input_image`` part, ``{"image_url": "data:...", "detail": ...}``, as an
    unread ImageSource; ``detail`` is accepted and changes nothing (the
    model's processor sets the resolution)."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        hint = " (file_id: uploaded files are not served)" if part.get("file_id") is not None else ""
        raise InvalidRequest(f"An input_image part needs 'image_url': 'data:image/...;base64,...'{hint}.",
                             param=f"{where}.image_url")
    if part.get("detail") not in DETAILS:
        raise InvalidRequest(f"Unknown image detail {part.get('detail')!r}; use 'auto', 'low' or 'high'.",
                             param=f"{where}.detail")
    return ImageSource(param=f"{where}.image_url", url=url)


def to_messages(items: list[dict] | tuple[dict, ...], instructions: str | None) -> list[dict]:
    """Chat messages for canonical ``items``, behind ``instructions`` as a
    system message. Consecutive function calls join the assistant turn before
    them, as chat's ``tool_calls``; their outputs are tool messages. Reasoning
    goes with the assistant turn after it (``reasoning_content``, ``thinking``:
    the variables Qwen3's and gpt-oss's templates read)."""
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    thought = ""  # reasoning that goes with the next assistant turn
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thought += item["content"]
        elif kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
            if item["role"] == "assistant" and thought:
                messages[-1].update(reasoning_content=thought, thinking=thought)  # Qwen3's, gpt-oss's
                thought = ""
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and not thought:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    messages[-1].update(reasoning_content=thought, thinking=thought)
                    thought = ""
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages
