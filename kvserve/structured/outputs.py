"""The engine's structured outputs: each constrained request's grammar, compiled when the request is
made (the compiler is built on the first one: unconstrained engines never build it), a step's
bitmask over the rows that sample, and the drawn tokens fed back to the matchers."""

from __future__ import annotations

import threading

import torch

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.grammar import Grammar, GrammarCompiler, new_bitmask


class StructuredOutputs:
    """Grammars over one tokenizer's vocabulary; `stop_token_ids` end every grammar (the EOS tokens)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()   # the server compiles on its tokenize thread, the engine on its own

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this model ships none")
                self._compiler = GrammarCompiler(self.tokenizer.hf_tokenizer, self.vocab_size, self.stop_token_ids)
            return self._compiler

    def precompile(self, params: StructuredOutputsParams | None) -> None:
        """Compile `params` now (xgrammar keeps the result), so that the request's own compile on the
        engine thread is a cache hit; ValueError as `grammar` raises it."""
        if params is not None:
            self.compiler.compile(params)

    def grammar(self, params: StructuredOutputsParams | None) -> Grammar | None:
        """A fresh matcher for a request with these params (None without a constraint); ValueError
        when the constraint cannot be compiled."""
        if params is None:
            return None
        return self.compiler.grammar(params)

    def bitmask(self, grammars: list[Grammar | None]) -> torch.Tensor | None:
        """The tokens each row may draw next (int32 [rows, words]; unconstrained rows allow all), or
        None when no row is constrained."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        mask = new_bitmask(len(grammars), self.vocab_size)
        for i in rows:
            grammars[i].fill(mask, i)
        return mask
