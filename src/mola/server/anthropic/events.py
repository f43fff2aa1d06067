"""One Anthropic Message and its stream events, built from what the chat
path's Generation yields (thinking text, text, tool calls). A stream sends
each event as it is made; a plain request builds the same way and keeps the
final message, so both answer alike.

The order of events (``RawMessageStreamEvent`` in Anthropic's SDK):

    message_start                      (the message, content empty, no stop_reason)
    per thinking block: content_block_start, content_block_delta (thinking_delta) ...,
                        content_block_delta (signature_delta), content_block_stop
    per text block:     content_block_start, content_block_delta (text_delta) ..., content_block_stop
    per tool_use block: content_block_start (input {}), content_block_delta
                        (input_json_delta: the whole input), content_block_stop
    message_delta                      (stop_reason, stop_sequence, final usage)
    message_stop

Whitespace that stands alone before a tool call opens no text block; an
answer of nothing at all has no blocks.
"""

from __future__ import annotations

import copy
import json
import uuid

from .convert import tool_use_block


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(num_prompt_tokens: int, num_tokens: int, num_cached_tokens: int,
          num_thinking_tokens: int | None = None) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens the prompt cache
    did not hold, cache_read_input_tokens those it did (their sum is the
    prompt). mola's cache fills itself, so nothing counts as created. Where
    the server splits reasoning off, output_tokens_details.thinking_tokens."""
    out = {"input_tokens": num_prompt_tokens - num_cached_tokens, "output_tokens": num_tokens,
           "cache_creation_input_tokens": 0, "cache_read_input_tokens": num_cached_tokens}
    if num_thinking_tokens is not None:
        out["output_tokens_details"] = {"thinking_tokens": num_thinking_tokens}
    return out


class MessageBuilder:
    def __init__(self, model: str, message_id: str | None = None):
        self.message = {"id": message_id or new_message_id(), "type": "message", "role": "assistant",
                        "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": usage(0, 0, 0)}
        self._open: dict | None = None  # the open text or thinking block
        self._blank = ""  # whitespace not yet known to begin a text block

    @property
    def num_tool_uses(self) -> int:
        return sum(b["type"] == "tool_use" for b in self.message["content"])

    def start(self, usage_now: dict) -> list[dict]:
        self.message["usage"] = dict(usage_now)
        return [_event("message_start", message=self.message)]

    def add(self, thinking: str, text: str, calls: list[dict]) -> list[dict]:
        """Events for one delta: its thinking, its text, then its tool calls."""
        events = self._stream_into("thinking", thinking) if thinking else []
        events += self._text(text) if text else []
        for call in calls:
            self._blank = ""
            events += self._close()
            events += self._tool_use(tool_use_block(call))
        return events

    def finish(self, stop_reason: str, stop_sequence: str | None, final_usage: dict) -> list[dict]:
        events = []
        if self._blank and not self.message["content"]:  # an answer of whitespace
            events += self._stream_into("text", self._blank)
        self._blank = ""
        events += self._close()
        self.message.update(stop_reason=stop_reason, stop_sequence=stop_sequence, usage=dict(final_usage))
        return events + [_event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                usage=final_usage),
                         _event("message_stop")]

    # ---- blocks ------------------------------------------------------------------

    def _text(self, text: str) -> list[dict]:
        if self._open is not None and self._open["type"] == "text":
            return self._stream_into("text", text)
        if not (self._blank + text).strip():
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return self._stream_into("text", text)

    def _stream_into(self, kind: str, text: str) -> list[dict]:
        """A delta of ``kind`` (text or thinking), opening a block of that kind first if needed."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            self._open = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            self.message["content"].append(self._open)
            events.append(_event("content_block_start", index=self._index(), content_block=self._open))
        self._open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else \
            {"type": "thinking_delta", "thinking": text}
        return events + [_event("content_block_delta", index=self._index(), delta=delta)]

    def _close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        index = self.message["content"].index(block)
        events = []
        if block["type"] == "thinking":  # mola's thinking is not signed: the signature is empty
            events.append(_event("content_block_delta", index=index,
                                 delta={"type": "signature_delta", "signature": block["signature"]}))
        return events + [_event("content_block_stop", index=index)]

    def _tool_use(self, block: dict) -> list[dict]:
        self.message["content"].append(block)
        index = self._index()
        return [_event("content_block_start", index=index, content_block={**block, "input": {}}),
                _event("content_block_delta", index=index,
                       delta={"type": "input_json_delta",
                              "partial_json": json.dumps(block["input"], ensure_ascii=False)}),
                _event("content_block_stop", index=index)]

    def _index(self) -> int:
        return len(self.message["content"]) - 1


def _event(type_: str, **fields) -> dict:
    """An event whose payload is copied now, so later growth of the message
    does not change it."""
    return {"type": type_, **copy.deepcopy(fields)}


def error_event(error_type: str, message: str) -> dict:
    """The event a stream ends with when generation fails part-way."""
    return {"type": "error", "error": {"type": error_type, "message": message}}
