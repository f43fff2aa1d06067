"""Tool calls in generated text, with mlx-lm's markers and parser for the
model's family (``tokenizer.tool_call_start`` / ``tool_call_end`` /
``tool_parser``), returned as OpenAI ``tool_calls``.

Text between the markers is held back and parsed when the call closes (or
when generation ends); a call that does not parse is returned as plain
content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import logging
import uuid

from mlx_lm.generate import TextStateMachine

from ..errors import InvalidRequest

log = logging.getLogger("mola.server")


def check_tool_support(tokenizer) -> None:
    if not getattr(tokenizer, "has_tool_calling", False):
        raise InvalidRequest(
            "This model has no tool-call parser (mlx-lm recognises none for its chat "
            "template), so tool calls could not be returned; omit 'tools' or set "
            "tool_choice to 'none'.",
            param="tools",
        )


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with JSON-string arguments, as chat templates
    expect them: arguments as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
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
            calls.append({
                "id": item.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            })
        self.num_calls += len(calls)
        return "", calls
