"""Tool calls in generated text, with mlx-lm's markers and parser for the
model's family (``tokenizer.tool_call_start`` / ``tool_call_end`` /
``tool_parser``), returned as OpenAI ``tool_calls``.

Text between the markers is held back and parsed when the call closes (or
when generation ends); a call that does not parse is returned as plain
content, so nothing the model wrote is lost.

Forced calls on a model whose template has no tool syntax mola has a grammar
for are bare JSON (mola.structured.JsonCalls), read by :class:`JsonCallParser`;
such a template sees earlier calls as that JSON in the assistant's content.
"""

from __future__ import annotations

import json
import logging
import uuid

from mlx_lm.generate import TextStateMachine

from ..errors import InvalidRequest

log = logging.getLogger("mola.server")


def check_tool_support(tokenizer) -> None:
    """Free tool calls (tool_choice auto) need a parser for the model's syntax."""
    if not getattr(tokenizer, "has_tool_calling", False):
        raise InvalidRequest(
            "This model has no tool-call parser (mlx-lm recognises none for its chat "
            "template), so tool calls under tool_choice 'auto' could not be returned; force "
            "them (tool_choice 'required' or a function: the output is held to the call's JSON), "
            "omit 'tools' or set tool_choice to 'none'.",
            param="tools",
        )


def chat_function(name: str, description=None, parameters=None, strict=None) -> dict:
    """A function tool in chat's shape, as chat templates and mlx-lm's tool
    parsers read it (the other APIs' tools are turned into this); fields
    left None are left out."""
    fn = {"name": name, "description": description, "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def tool_call(name: str, arguments: str, id: str | None = None) -> dict:
    """One call in chat's ``tool_calls`` shape (``arguments``: a JSON string)."""
    return {"id": id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def messages_for_template(messages: list[dict], template: str | None = None) -> list[dict]:
    """Assistant tool calls with JSON-string arguments, as chat templates
    expect them: arguments as objects. A ``template`` that never reads
    ``tool_calls`` gets them as the JSON list forced calls are written in,
    appended to the assistant's content, so that the model sees its calls."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and isinstance(template, str) and "tool_calls" not in template:
            listed = json.dumps([_as_json_call(c) for c in calls], ensure_ascii=False)
            m = {**m, "content": _with_text(m.get("content"), listed)}
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                call["function"] = fn
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def _with_text(content, text: str):
    """``content`` (a string, None, or a list of parts) with ``text`` after it."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return f"{content}\n{text}" if content else text


def _as_json_call(call: dict) -> dict:
    fn = call.get("function") or {}
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"name": fn.get("name"), "arguments": arguments}


class JsonCallParser:
    """Forced calls written as bare JSON (``json_calls``: mola.structured.JsonCalls).
    A list's calls are returned as each one closes; a named function's
    arguments when generation ends. What does not parse (output cut off by
    max_tokens) is returned as content from where the last call ended."""

    def __init__(self, json_calls):
        self._name = json_calls.name  # the named function (the output is its arguments), or None: a list
        self._text = ""
        self._at = 0  # where the list's next item starts (0: before its "[")
        self._decoder = json.JSONDecoder()
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        return "", ([] if self._name is not None else self._list_items())

    def finish(self) -> tuple[str, list[dict]]:
        if self._name is None:
            calls = self._list_items()
            rest = self._text[self._at:].strip(" \t\r\n,") if self._at else self._text
            return ("" if rest in ("]", "") else rest), calls
        try:
            value = json.loads(self._text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            return self._text, []
        self.num_calls += 1
        return "", [tool_call(self._name, self._text.strip())]

    def _list_items(self) -> list[dict]:
        """Calls of the list items completed since the last look."""
        text, calls = self._text, []
        if self._at == 0:
            start = len(text) - len(text.lstrip())
            if text[start:start + 1] != "[":
                return calls
            self._at = start + 1
        while True:
            at = self._at
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            try:
                item, end = self._decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return calls
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("arguments"), dict)):
                return calls
            calls.append(tool_call(item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
            self.num_calls += 1
            self._at = end


class ToolCallParser:
    """Splits one choice's text into content and tool calls."""

    def __init__(self, tokenizer, tools: list[dict]):
        self._start = tokenizer.tool_call_start
        self._end = tokenizer.tool_call_end
        self._parse = tokenizer.tool_parser
        self._tools = tools
        transitions = {"normal": [(self._start, "tool")],
                       "tool": [(self._end, "normal")] if self._end else []}
        self._sm = TextStateMachine(transitions)
        self._state = self._sm.make_state("normal")
        self._tool_text = ""
        self._in_tool = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Returns (content to emit, tool calls completed)."""
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._consume(segments)

    def finish(self) -> tuple[str, list[dict]]:
        self._state, rest, current = TextStateMachine.flush(self._state)
        content, calls = self._consume([(current, rest)])
        if self._in_tool:  # generation ended inside a call (no end marker)
            more_content, more_calls = self._close(ended=False)
            content, calls = content + more_content, calls + more_calls
        return content, calls

    def _consume(self, segments) -> tuple[str, list[dict]]:
        content, calls = "", []
        for state, text in segments:
            if state == "tool":
                self._in_tool = True
                self._tool_text += text
                continue
            if self._in_tool:
                c, k = self._close()
                content += c
                calls += k
            content += text
        return content, calls

    def _close(self, ended: bool = True) -> tuple[str, list[dict]]:
        """Parse the call just closed (``ended``: by its end marker)."""
        text, self._tool_text, self._in_tool = self._tool_text, "", False
        end = (self._end or "") if ended else ""
        as_text = f"{self._start}{text}{end}"
        try:
            parsed = self._parse(text, self._tools)
        except Exception as e:  # the parsers raise ValueError / JSONDecodeError / KeyError
            log.warning("tool call did not parse (%s: %s); returned as content", type(e).__name__, e)
            return as_text, []
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(item, dict) or "name" not in item:
                return as_text, []
            arguments = item.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(tool_call(item["name"], arguments, item.get("id")))
        self.num_calls += len(calls)
        return "", calls
