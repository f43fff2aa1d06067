"""Anthropic messages <-> the chat messages the model's template renders, and
the chat path's tool calls and finish reasons -> Anthropic's blocks and stop
reasons.

In:
    system (a string or text blocks)      -> a system message
    user text blocks                      -> a user message
    user image blocks (base64 or url)     -> image parts of the user message, in order
                                             ({"type": "image", "source": ImageSource},
                                             decoded by the pipeline: frontend/images_in.py)
    user tool_result blocks               -> tool messages (tool_call_id), in order
    assistant text blocks                 -> the assistant message's content
    assistant tool_use blocks             -> its tool_calls (arguments as JSON)
    assistant thinking blocks             -> its reasoning_content (and thinking), as chat's
                                             messages carry it (prompts.message_dicts)
    assistant redacted_thinking           -> dropped

Text blocks of one message (and of the system prompt) are joined with a
newline, as vLLM joins a message's text parts; consecutive turns of one role
are combined into one, as Anthropic's API combines them. ``cache_control``
marks are accepted anywhere and change nothing: mola's prompt cache is
automatic. A user message with images has a list of parts for its content
(its text blocks joined between images). Images anywhere else, documents and
server-tool blocks are refused, naming the block.
"""

from __future__ import annotations

import json

from ...errors import InvalidRequest
from ...frontend.images_in import ImageSource
from .protocol import Conversation

BLOCK_SEPARATOR = "\n"
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")


def to_chat_messages(body: Conversation) -> list[dict]:
    """Chat messages for the request's system prompt and messages."""
    if body.messages[-1].role == "assistant":
        raise InvalidRequest(
            "The last message is the assistant's: continuing a prefilled assistant turn is not "
            "supported by this server; end the conversation with a user message.",
            param=f"messages[{len(body.messages) - 1}].role")
    messages = []
    if body.system is not None:
        system = _text(body.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        converted = _assistant(m.content, where) if m.role == "assistant" else _user(m.content, where)
        for message in converted:
            _append(messages, message)
    return messages


def _append(messages: list[dict], message: dict) -> None:
    """Append, combining with the turn before when it has the same role."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != message["role"] or message["role"] not in ("user", "assistant"):
        messages.append(message)
        return
    if isinstance(last["content"], list) or isinstance(message["content"], list):
        last["content"] = _joined([*_as_parts(last["content"]), *_as_parts(message["content"])])
    else:
        last["content"] = BLOCK_SEPARATOR.join(c for c in (last["content"], message["content"]) if c)
    if message.get("tool_calls"):
        last.setdefault("tool_calls", []).extend(message["tool_calls"])
    if message.get("reasoning_content"):
        joined = BLOCK_SEPARATOR.join(r for r in (last.get("reasoning_content"), message["reasoning_content"]) if r)
        last["reasoning_content"] = last["thinking"] = joined


def _user(content, where: str) -> list[dict]:
    """A user turn: tool messages for its tool_result blocks and a user
    message for its text and images, in the order they come."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, parts = [], []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": _joined(parts)})
                parts = []
            out.append(_tool_result(block, f"{where}[{j}]"))
        elif kind == "text":
            parts.append({"type": "text", "text": _block_text(block, f"{where}[{j}]")})
        elif kind == "image":
            parts.append({"type": "image", "source": _image_source(block, f"{where}[{j}]")})
        else:
            raise _unsupported(kind, f"{where}[{j}]", "text, image and tool_result")
    if parts or not out:
        out.append({"role": "user", "content": _joined(parts)})
    return out


def _image_source(block: dict, where: str) -> ImageSource:
    """An image block's source, unread: ``{"type": "base64", "media_type", "data"}``
    or ``{"type": "url", "url"}`` (fetched only with --allow-remote-images)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not isinstance(source.get("data"), str):
            raise InvalidRequest("A base64 image source needs 'media_type' and 'data' strings.",
                                 param=f"{where}.source")
        return ImageSource(param=f"{where}.source", media_type=media_type, data=source["data"])
    if kind == "url":
        if not isinstance(source.get("url"), str) or not source["url"]:
            raise InvalidRequest("A url image source needs a 'url' string.", param=f"{where}.source.url")
        return ImageSource(param=f"{where}.source.url", url=source["url"])
    raise InvalidRequest(f"Unsupported image source type {kind!r}; use 'base64' (or 'url').",
                         param=f"{where}.source")


def _as_parts(content) -> list[dict]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}] if content else []


def _joined(parts: list[dict]) -> str | list[dict]:
    """Text blocks joined with BLOCK_SEPARATOR: one string, or with images,
    a list of parts whose adjacent texts are joined."""
    out: list[dict] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": BLOCK_SEPARATOR.join((out[-1]["text"], part["text"]))}
        else:
            out.append(part)
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _assistant(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}]
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}[{j}]"))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise InvalidRequest("A thinking block needs a 'thinking' string.", param=f"{where}[{j}].thinking")
            thoughts.append(block["thinking"])
        elif kind != "redacted_thinking":
            raise _unsupported(kind, f"{where}[{j}]", "text, tool_use and thinking")
    message = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    if any(thoughts):  # what Qwen3's template reads, and gpt-oss's
        message["reasoning_content"] = message["thinking"] = BLOCK_SEPARATOR.join(t for t in thoughts if t)
    return [message]


def _tool_use(block: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise InvalidRequest(f"A tool_use block needs a non-empty '{key}' string.", param=f"{where}.{key}")
    if not isinstance(block.get("input"), dict):
        raise InvalidRequest("A tool_use block's 'input' must be an object.", param=f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict, where: str) -> dict:
    """A tool message. ``is_error`` has no place in chat templates: the
    result's text is all the model sees."""
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise InvalidRequest("A tool_result block needs a non-empty 'tool_use_id' string.",
                             param=f"{where}.tool_use_id")
    content = block.get("content", "")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _text(content, f"{where}.content")}


def _text(content, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Expected a string or a list of text blocks, got {type(content).__name__}.",
                             param=where)
    texts = []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind != "text":
            raise _unsupported(kind, f"{where}[{j}]", "text")
        texts.append(_block_text(block, f"{where}[{j}]"))
    return BLOCK_SEPARATOR.join(texts)


def _kind(block, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest("Each content block must be an object with a 'type'.", param=where)
    return block["type"]


def _block_text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequest("A text block needs a 'text' string.", param=f"{where}.text")
    return block["text"]


def _unsupported(kind: str, where: str, allowed: str) -> InvalidRequest:
    if kind == "image":
        return InvalidRequest("Image blocks are taken in user messages only, on a base that takes images "
                              "(docs/vision.md).", param=where)
    if kind in MEDIA_BLOCKS:
        return InvalidRequest(f"Content blocks of type {kind!r} are not supported: this server serves "
                              "text and image blocks.", param=where)
    return InvalidRequest(f"Content blocks of type {kind!r} are not supported here; use {allowed} blocks.",
                          param=where)


# ---- out: the chat path's results as Anthropic's ----------------------------------------


def tool_use_block(call: dict) -> dict:
    """A chat tool call (mola/frontend/tools.py) as a tool_use block. Its
    arguments are the JSON the model wrote; ones that are not an object
    (a parser may return any JSON) are wrapped as ``{"arguments": ...}``."""
    arguments = call["function"]["arguments"]
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = arguments
    tool_id = call["id"]
    if tool_id.startswith("call_"):
        tool_id = "toolu_" + tool_id[len("call_"):]
    return {"type": "tool_use", "id": tool_id, "name": call["function"]["name"],
            "input": value if isinstance(value, dict) else {"arguments": value}}


def stop_reason(finish_reason: str | None, stop_string: str | None, has_tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how the chat path's generation ended."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def thinking_text(delta) -> str:
    """The thinking in one of the chat path's deltas (choice.Delta's
    ``reasoning``, split off by --reasoning-parser), for thinking blocks:
    nothing where the server splits none off."""
    return delta.reasoning
