"""Grammars -> per-sequence constraints, for one tokenizer.

:class:`StructuredOutputs` is what a route (or another API built on mola)
calls: ``for_request(...)`` checks a request's ``response_format`` /
``tool_choice`` and returns a :class:`CompiledGrammar` (or None for free
text); each sequence then takes its own matcher from it with
``new_constraint()``. Compiled grammars are cached (an LRU keyed by the
grammar text), so a schema that comes back is compiled once; every sequence's
matcher is a copy of the cached one.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import llguidance
import llguidance.hf

from ..engine.constraint import Constraint
from ..errors import InvalidRequest
from .grammar import Grammar, Thinking, grammar_for

CACHE_SIZE = 64  # compiled grammars kept


@dataclass
class CompiledGrammar:
    grammar: Grammar
    matcher: llguidance.LLMatcher  # in its start state; never advanced
    vocab_size: int
    compile_seconds: float

    def new_constraint(self) -> Constraint:
        """A fresh matcher for one sequence (each choice of n gets its own)."""
        return Constraint(self.matcher.deep_copy(), self.grammar.lark, self.vocab_size)


class StructuredOutputs:
    """Compiles grammars for one model's tokenizer. Thread-safe; the
    llguidance tokenizer is built on first use (about a second for a large
    vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer  # mlx-lm TokenizerWrapper
        self.vocab_size = vocab_size  # the model's logits
        self.cache_size = cache_size
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = self._build_tokenizer()
            return self._ll

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        try:
            n_vocab = max(self.vocab_size, len(hf))
            return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab,
                                                eos_token=sorted(self.tokenizer.eos_token_ids))
        except Exception as e:  # a slow or non-HF tokenizer
            raise InvalidRequest(
                f"Structured output needs a fast Hugging Face tokenizer, and this model's "
                f"({type(hf).__name__}) could not be read by llguidance: {e}", param="response_format")

    def literal(self, text: str) -> str:
        """A marker in Lark: its special token when it is one, else its text."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text, ensure_ascii=False)

    def for_request(self, *, response_format: Any = None, tools: list[dict] | None = None,
                    tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                    format_param: str = "response_format",
                    thinking: Callable[[Callable[[str], str]], Thinking | None] | None = None,
                    ) -> CompiledGrammar | None:
        """The compiled grammar a request's output must follow (None: free).
        ``thinking(literal)``: what a thinking model writes before its answer
        (mola.frontend.reasoning), which the grammar leaves free. Raises
        InvalidRequest naming what cannot be constrained."""
        grammar = grammar_for(self.tokenizer, self.literal, response_format=response_format,
                              tools=tools, tool_choice=tool_choice,
                              parallel_tool_calls=parallel_tool_calls, format_param=format_param,
                              thinking=thinking(self.literal) if thinking else None)
        return None if grammar is None else self.compile(grammar)

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(grammar.lark)
            if hit is not None:
                self._cache.move_to_end(grammar.lark)
                # One text can stand for two requests (a json_schema format and a named
                # call's arguments): the matcher is shared, what it means is the caller's.
                return hit if hit.grammar == grammar else dataclasses.replace(hit, grammar=grammar)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark),
                                       log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"The {grammar.param} could not be compiled into a grammar: "
                                 f"{matcher.get_error()}", param=grammar.param)
        compiled = CompiledGrammar(grammar, matcher, self.ll_tokenizer.vocab_size,
                                   time.perf_counter() - start)
        with self._lock:
            self._cache[grammar.lark] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def rebuild(self, lark: str) -> Constraint:
        """A constraint from grammar text alone (another rank's copy)."""
        return self.compile(Grammar(lark, "replica", "response_format")).new_constraint()
