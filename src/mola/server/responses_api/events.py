"""One response's output items and typed stream events, built from the
reasoning, text and tool calls its Generation yields (``ResponseStreamEvent`` in OpenAI's
openapi.yaml). A stream sends each event as it is made; a plain request
builds the same way and keeps the final Response.

The order of events:

    response.created, response.in_progress
    per reasoning: response.output_item.added, response.content_part.added,
                  response.reasoning_text.delta ..., response.reasoning_text.done,
                  response.content_part.done, response.output_item.done
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Whitespace that stands alone before a tool call opens no message; an answer
that is nothing but whitespace (or empty) is still one message.
"""

from __future__ import annotations

import copy

from ...errors import MolaError, Overloaded
from . import objects as o


class ResponseBuilder:
    def __init__(self, fields: dict, response_id: str | None = None):
        self.fields = fields  # objects.request_fields(body)
        self.id = response_id or o.new_id("resp")
        self.created_at = o.now()
        self.output: list[dict] = []  # items, kept current as they grow
        self.response: dict = self._snapshot("in_progress")
        self._seq = 0
        self._message: dict | None = None  # the open message item
        self._reasoning: dict | None = None  # the open reasoning item
        self._blank = ""  # whitespace not yet known to begin a message

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def add(self, text: str, calls: list[dict], reasoning: str = "") -> list[dict]:
        """Events for one delta: its reasoning, its text, then its completed tool calls."""
        events = self._think(reasoning) if reasoning else []
        events += self._text(text) if text else []
        for call in calls:
            self._blank = ""
            events += self._close_reasoning("completed") + self._close_message("completed")
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, input_tokens: int, output_tokens: int,
               cached_tokens: int = 0, reasoning_tokens: int = 0) -> list[dict]:
        incomplete = finish_reason == "length"
        events = self._close_reasoning("incomplete" if incomplete else "completed")
        if all(item["type"] == "reasoning" for item in self.output):  # no answer item yet: this text is it
            events += self._open_message()
            events += self._delta(self._blank) if self._blank else []
        self._blank = ""
        events += self._close_message("incomplete" if incomplete else "completed")
        usage = o.usage(input_tokens, output_tokens, cached_tokens, reasoning_tokens)
        if incomplete:
            self.response = self._snapshot("incomplete", usage=usage, incomplete_reason="max_output_tokens")
            return events + [self._event("response.incomplete", response=self.response)]
        self.response = self._snapshot("completed", usage=usage, completed_at=o.now())
        return events + [self._event("response.completed", response=self.response)]

    def fail(self, error: MolaError, input_tokens: int, output_tokens: int,
             cached_tokens: int = 0, reasoning_tokens: int = 0) -> list[dict]:
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        code = "rate_limit_exceeded" if isinstance(error, Overloaded) else "server_error"
        self.response = self._snapshot("failed", usage=o.usage(input_tokens, output_tokens, cached_tokens,
                                                               reasoning_tokens),
                                       error={"code": code, "message": error.message})
        return [self._event("response.failed", response=self.response)]

    # ---- items -------------------------------------------------------------------

    def _text(self, text: str) -> list[dict]:
        if self._message is not None:
            return self._delta(text)
        if not (self._blank + text).strip():
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return self._close_reasoning("completed") + self._open_message() + self._delta(text)

    def _think(self, text: str) -> list[dict]:
        """Reasoning text: into the open reasoning item, or a new one (which
        closes an open message: harmony may think again after answering)."""
        events = []
        if self._reasoning is None:
            events += self._close_message("completed")
            part = o.reasoning_part("")
            self._reasoning = o.reasoning_item(o.new_id("rs"), "in_progress", [part])
            self.output.append(self._reasoning)
            where = self._where(self._reasoning)
            events += [self._event("response.output_item.added", output_index=where["output_index"],
                                   item={**self._reasoning, "content": []}),
                       self._event("response.content_part.added", **where, content_index=0, part=part)]
        self._reasoning["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", **self._where(self._reasoning),
                                     content_index=0, delta=text)]

    def _close_reasoning(self, status: str) -> list[dict]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item["status"] = status
        part, where = item["content"][0], self._where(item)
        return [self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _open_message(self) -> list[dict]:
        part = o.text_part("")
        self._message = o.message_item(o.new_id("msg"), "in_progress", [part])
        self.output.append(self._message)
        where = self._where(self._message)
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item={**self._message, "content": []}),
                self._event("response.content_part.added", **where, content_index=0, part=part)]

    def _delta(self, text: str) -> list[dict]:
        self._message["content"][0]["text"] += text
        return [self._event("response.output_text.delta", **self._where(self._message), content_index=0,
                            delta=text, logprobs=[])]

    def _close_message(self, status: str) -> list[dict]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        part, where = item["content"][0], self._where(item)
        return [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                            logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _call(self, call: dict) -> list[dict]:
        item = o.function_call_item(o.new_id("fc"), call, "in_progress", arguments="")
        self.output.append(item)
        where = self._where(item)
        events = [self._event("response.output_item.added", output_index=where["output_index"], item=item)]
        item["arguments"], item["status"] = call["function"]["arguments"], "completed"
        events += [
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]
        return events

    # ---- plumbing ----------------------------------------------------------------

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _snapshot(self, status: str, **extra) -> dict:
        return o.response(self.fields, self.id, self.created_at, status, copy.deepcopy(self.output), **extra)

    def _event(self, type_: str, **fields) -> dict:
        """An event with the next sequence number; its payload is copied now,
        so later growth of the items does not change it."""
        event = {"type": type_, "sequence_number": self._seq, **copy.deepcopy(fields)}
        self._seq += 1
        return event
