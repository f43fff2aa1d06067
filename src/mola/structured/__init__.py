"""Structured outputs: response_format and forced tool calls as grammars
(llguidance), one matcher per sequence. See compiler.StructuredOutputs."""

from .compiler import CompiledGrammar, StructuredOutputs
from .grammar import Grammar, grammar_for

__all__ = ["CompiledGrammar", "Grammar", "StructuredOutputs", "grammar_for"]
