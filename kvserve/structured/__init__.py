"""Structured outputs: a grammar per request (JSON schema, regex, choice, EBNF) compiled by xgrammar
over the model's vocabulary; each step a token bitmask per constrained row masks the logits before
sampling, and each drawn token advances the request's matcher (docs/STRUCTURED.md)."""

from kvserve.structured.grammar import Grammar, GrammarCompiler, apply_bitmask

__all__ = ["Grammar", "GrammarCompiler", "apply_bitmask"]
