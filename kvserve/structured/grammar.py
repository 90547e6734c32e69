"""Grammars for structured outputs, through xgrammar.

`GrammarCompiler` turns a request's StructuredOutputsParams into a compiled grammar (cached by
xgrammar per constraint) over the model's vocabulary, the engine's EOS tokens being the grammar's
stop tokens; a constraint it cannot compile is a ValueError that says why. `Grammar` is one
request's matcher: the bitmask of the tokens it allows next, and the tokens it accepts.
"""

from __future__ import annotations

import json
import logging
import re

import torch

from kvserve.sampling_params import StructuredOutputsParams

log = logging.getLogger("kvserve")

BITS = 32   # tokens per bitmask word (xgrammar's int32 layout: bit j of word w is token 32 w + j)


class GrammarCompiler:
    """Compiles constraints over one tokenizer's vocabulary (`vocab_size` rows of the logits)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of `params`; ValueError naming the constraint and xgrammar's reason."""
        try:
            return self._compile(params)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _reason(exc)
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {reason}") from None

    def _compile(self, params: StructuredOutputsParams):
        c, kind = self._compiler, params.kind
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            json.loads(schema)   # a clear message for text that is not JSON
            return c.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(params.choice))
        if kind == "grammar":
            return c.compile_grammar(params.grammar)
        return c.compile_structural_tag(params.structural_tag)

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one request."""
        return Grammar(self.compile(params), self.vocab_size)


def _reason(exc: Exception) -> str:
    """The first line of xgrammar's message, without its time and source-file prefix."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+: ", "", text.splitlines()[0])[:300]


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class Grammar:
    """One request's position in its grammar."""

    def __init__(self, compiled, vocab_size: int, matcher=None):
        import xgrammar as xgr

        self.compiled = compiled
        self.vocab_size = vocab_size
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32 [rows, words])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no move) when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def done(self) -> bool:
        """True once the grammar has accepted its stop token."""
        return self.matcher.is_terminated()

    def fork(self) -> Grammar:
        """An independent copy at the same position (a fork of the request: n > 1)."""
        return Grammar(self.compiled, self.vocab_size, self.matcher.fork())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask [rows, ceil(vocab / 32)] (int32, every bit set)."""
    return torch.full((rows, -(-vocab_size // BITS)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens the bitmask does not allow to -inf (in place). logits [rows, V]."""
    vocab = logits.shape[-1]
    bits = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
