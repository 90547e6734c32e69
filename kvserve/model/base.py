"""The part every decoder shares: the LM head, logits, and what the KV cache needs to know."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.kv.spec import KVSpec
from kvserve.model.config import ModelConfig


class CausalLM(nn.Module):
    """`model` (embeddings, layers whose `self_attn` has `spec` and `kv_rows`, final norm) + LM head."""

    def __init__(self, cfg: ModelConfig, model: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] in float32 (soft-capped when the model says so)."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def kv_specs(self) -> list[KVSpec]:
        """What each layer stores in the KV cache per token."""
        return [layer.self_attn.spec for layer in self.model.layers]

    @property
    def kv_rows(self) -> int:
        """Token rows whose K/V (or latent) were projected, per layer (summed / num_layers)."""
        layers = self.model.layers
        return sum(layer.self_attn.kv_rows for layer in layers) // len(layers)
