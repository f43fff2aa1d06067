"""Reasoning: a thinking model's output split, as it streams, into its
reasoning and its answer (``--reasoning-parser``), one parser class per format:

- ``qwen3``: ``<think>...</think>`` (Qwen3). ``enable_thinking: false`` makes
  the template close an empty thinking in the prompt; the output is then all answer.
- ``deepseek_r1``: ``<think>...</think>`` after a prompt that opens it
  (DeepSeek-R1 and its distills).
- ``gpt_oss``: OpenAI's harmony messages: the ``analysis`` channel is
  reasoning, ``final`` the answer, ``commentary`` to ``functions.NAME`` a tool call.

``auto`` (:func:`detect`) picks one from the chat template. As vLLM reads
them: output before the end of thinking is reasoning, a leading start marker
is dropped, and an output that never ends its thinking is all reasoning.

A format also says, from the end of the rendered prompt, whether the output
starts inside the thinking (:meth:`ReasoningFormat.start`), and gives the
grammar of the thinking (mola.structured.Thinking), which structured outputs
and forced tool calls leave free before the answer they hold to a schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from ..config import REASONING_PARSERS
from ..structured import Thinking, until
from .tools import tool_call

GAP = "/[ \\t\\r\\n]{0,4}/"  # whitespace a grammar allows between the thinking and the answer
PROMPT_TAIL_TOKENS = 16  # tokens at the end of a prompt read for an open or closed thinking


@dataclass
class Split:
    """What a piece of output holds: reasoning, answer text, and tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that may still become a marker."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


# ---- <think> tags ------------------------------------------------------------------------


class ThinkParser:
    """``<think>`` reasoning ``</think>`` answer, streamed. Leading whitespace
    of each part is dropped (the templates write "\\n" after both markers)."""

    def __init__(self, start: str, end: str, thinking: bool):
        self.start, self.end = start, end
        self.in_reasoning = thinking  # before the end marker
        self._opening = thinking  # the optional start marker may still come
        self._buf = ""  # text not yet returned
        self._strip = True  # at the start of a part: drop whitespace

    def feed(self, text: str) -> Split:
        self._buf += text
        out = Split()
        if self.in_reasoning:
            if self._opening:
                head = self._buf.lstrip()
                if head.startswith(self.start):
                    self._buf, self._opening = head[len(self.start):], False
                elif self.start.startswith(head):
                    return out  # whitespace, or a prefix of the start marker
                else:
                    self._opening = False
            at = self._buf.find(self.end)
            if at < 0:
                cut = len(self._buf) - _held(self._buf, (self.end,))
                out.reasoning, self._buf = self._lead(self._buf[:cut]), self._buf[cut:]
                return out
            out.reasoning = self._lead(self._buf[:at])
            self._buf, self.in_reasoning, self._strip = self._buf[at + len(self.end):], False, True
        out.content, self._buf = self._lead(self._buf), ""
        return out

    def finish(self) -> Split:
        text, self._buf = self._lead(self._buf), ""
        return Split(reasoning=text) if self.in_reasoning else Split(content=text)

    def _lead(self, text: str) -> str:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text


# ---- harmony (gpt-oss) ---------------------------------------------------------------------

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
BODY_ENDS = (END, CALL, RETURN, START)
MAX_HEADER_CHARS = 512  # a header this long without <|message|> is no header: the text is the answer


class HarmonyParser:
    """Harmony messages, streamed: each is a header (``<|start|>assistant``,
    ``<|channel|>NAME``, ``to=RECIPIENT``, ``<|constrain|>json``) up to
    ``<|message|>``, then a body up to ``<|end|>`` (or ``<|call|>`` /
    ``<|return|>``, which end the generation and may not reach the text).
    ``analysis`` bodies are reasoning; those to ``functions.NAME`` are tool
    calls (with ``tools``, else answer text); ``final`` and other bodies the answer."""

    def __init__(self, tools: bool):
        self._tools = tools
        self._buf = ""
        self._kind: str | None = None  # None: in a header; "reasoning", "content" or "call"
        self._name = ""  # the function a call body calls
        self._args = ""
        self.in_reasoning = False

    def feed(self, text: str) -> Split:
        self._buf += text
        out = Split()
        while True:
            if self._kind is None:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if len(self._buf) > MAX_HEADER_CHARS and MESSAGE not in self._buf:
                        self._kind = "content"  # not harmony: answer text
                        continue
                    self.in_reasoning = _channel(self._buf) == "analysis"
                    return out
                self._open(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE):]
                continue
            hits = [(at, m) for m in BODY_ENDS if (at := self._buf.find(m)) >= 0]
            if not hits:
                cut = len(self._buf) - _held(self._buf, BODY_ENDS)
                self._body(out, self._buf[:cut])
                self._buf = self._buf[cut:]
                return out
            at, marker = min(hits)
            self._body(out, self._buf[:at])
            self._close(out)
            self._buf = self._buf[at if marker == START else at + len(marker):]

    def finish(self) -> Split:
        out = Split()
        if self._kind is None:
            if self._buf.strip() and "<|" not in self._buf:
                out.content = self._buf  # plain text, no harmony at all
        else:
            self._body(out, self._buf)
            self._close(out)
        self._buf = ""
        return out

    def _open(self, header: str) -> None:
        recipient = re.search(r"\bto=([^\s<]+)", header)
        to = recipient.group(1) if recipient else None
        if to is not None and to.startswith("functions."):
            if self._tools:
                self._kind, self._name, self._args = "call", to[len("functions."):], ""
            else:
                self._kind = "content"  # no tools in the request: the call's text is the answer
        elif to is not None or _channel(header) == "analysis":
            self._kind = "reasoning"  # the thinking, and calls to built-in tools mola does not run
        else:
            self._kind = "content"
        self.in_reasoning = self._kind == "reasoning"

    def _body(self, out: Split, text: str) -> None:
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "call":
            self._args += text
        else:
            out.content += text

    def _close(self, out: Split) -> None:
        if self._kind == "call":
            args = self._args.strip()
            try:
                json.loads(args)
                out.calls.append(tool_call(self._name, args))
            except json.JSONDecodeError:
                out.content += args  # not a call after all (cut off): kept as text
        self._kind, self._args, self.in_reasoning = None, "", False


def _channel(header: str) -> str | None:
    found = re.search(re.escape(CHANNEL) + r"\s*(\w+)", header)
    return found.group(1) if found else None


# ---- formats -------------------------------------------------------------------------------


class ReasoningFormat:
    """One server's reasoning format (stateless): its markers, its parsers and
    the grammar of its thinking."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # what the parser reads: kept in the text even if special
    parses_tools: ClassVar[bool] = False  # its parser returns tool calls (harmony)

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.marker_ids = frozenset(vocab[m] for m in self.markers if m in vocab)

    def thinks_first(self, prompt_tail: str) -> bool:
        """Does an output after a prompt ending in ``prompt_tail`` start in its thinking?"""
        return True

    def parser(self, thinking: bool, tools: bool):
        raise NotImplementedError

    def thinking(self, literal: Callable[[str], str], thinking: bool) -> Thinking | None:
        raise NotImplementedError

    def start(self, tokenizer, prompt: list[int]) -> Reasoning:
        """The request whose prompt is ``prompt`` (token ids)."""
        tail = tokenizer.decode(list(prompt[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return Reasoning(self, self.thinks_first(tail))


class Qwen3(ReasoningFormat):
    name = "qwen3"
    markers = ("<think>", "</think>")

    def thinks_first(self, prompt_tail: str) -> bool:
        return not prompt_tail.rstrip().endswith(self.markers[1])  # enable_thinking false closes it

    def parser(self, thinking: bool, tools: bool) -> ThinkParser:
        return ThinkParser(*self.markers, thinking)

    def thinking(self, literal, thinking: bool) -> Thinking | None:
        if not thinking:
            return None
        start, end = self.markers
        return Thinking(f"thinking: {literal(start)}? think_text {GAP}\n" + until("think_text", end, literal))


class DeepSeekR1(Qwen3):
    """As Qwen3's: the template opens <think> in the prompt, so the output
    is reasoning up to </think> (a leading <think> is dropped)."""

    name = "deepseek_r1"


class GptOss(ReasoningFormat):
    name = "gpt_oss"
    markers = (START, END, MESSAGE, CHANNEL, CALL, RETURN, CONSTRAIN)
    parses_tools = True

    def parser(self, thinking: bool, tools: bool) -> HarmonyParser:
        return HarmonyParser(tools)

    def thinking(self, literal, thinking: bool) -> Thinking:
        """Analysis messages, then the answer's header: the final channel for
        content, the commentary channel to a function for a call."""
        rules = (f"thinking: analysis*\n"
                 f"analysis: {literal(CHANNEL)} \"analysis\" {literal(MESSAGE)} analysis_text "
                 f"{literal(START)} \"assistant\"\n" + until("analysis_text", END, literal))
        return Thinking(rules, content=f"{literal(CHANNEL)} \"final\" {literal(MESSAGE)}", tool_family="harmony")


FORMATS: dict[str, type[ReasoningFormat]] = {f.name: f for f in (Qwen3, DeepSeekR1, GptOss)}


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning: its format, and whether its output starts in
    the thinking (not when the template closed it in the prompt)."""

    format: ReasoningFormat
    thinks_first: bool

    def parser(self, tools: bool = False):
        """A streaming parser for one choice (``tools``: read tool calls too)."""
        return self.format.parser(self.thinks_first, tools)

    def grammar(self, literal: Callable[[str], str]) -> Thinking | None:
        """What mola.structured leaves free before the constrained answer."""
        return self.format.thinking(literal, self.thinks_first)


def detect(tokenizer) -> str | None:
    """The format a chat template writes, or None: harmony's channels; <think>
    tags where the template reads enable_thinking or its generation prompt
    opens <think> (a template that only strips </think> from history is not
    enough). DeepSeek's role markers tell R1 from Qwen3."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if CHANNEL in template and MESSAGE in template:
        return GptOss.name
    if "<think>" not in template and "</think>" not in template:
        return None
    if "enable_thinking" not in template:
        try:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                   add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that wants other messages: read no thinking into it
            return None
        if not prompt.rstrip().endswith("<think>"):
            return None
    return DeepSeekR1.name if "<｜Assistant｜>" in template else Qwen3.name


def reasoning_format(name: str, tokenizer) -> ReasoningFormat | None:
    """The format ``--reasoning-parser NAME`` serves (auto: from the chat template)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    if name == "auto":
        name = detect(tokenizer) or "none"
    return None if name == "none" else FORMATS[name](tokenizer)
