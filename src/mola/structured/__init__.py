"""Structured outputs: response_format and forced tool calls as grammars
(llguidance), one matcher per sequence. See compiler.StructuredOutputs."""

from .compiler import CompiledGrammar, StructuredOutputs
from .grammar import Grammar, JsonCalls, Thinking, grammar_for, until

__all__ = ["CompiledGrammar", "Grammar", "JsonCalls", "StructuredOutputs", "Thinking", "grammar_for", "until"]
