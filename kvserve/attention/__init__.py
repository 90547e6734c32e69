"""Attention over the KV cache: one backend per KV group (backends.py), chosen once at start-up;
the layer's formula (math.py); the step's metadata (metadata.py)."""

from __future__ import annotations

import torch

from kvserve.attention.backends import (
    NO_CACHE,
    AttentionBackends,
    GatheredBackend,
    NoCacheBackend,
    PagedBackend,
    StepBatch,
    select_backend,
)
from kvserve.attention.math import MHA, MLA
from kvserve.attention.metadata import (
    AttentionMetadata,
    CapturedInputs,
    Context,
    DecodeChunks,
    DecodeRange,
    GatheredMetadata,
    PagedMetadata,
    PrefillSpan,
    window_mask,
)
from kvserve.attention.paged import paged_decode, plan_chunks

__all__ = ["MHA", "MLA", "NO_CACHE", "AttentionBackends", "AttentionMetadata", "CapturedInputs", "Context",
           "DecodeChunks", "DecodeRange", "GatheredBackend", "GatheredMetadata", "NoCacheBackend", "PagedBackend",
           "PagedMetadata", "PrefillSpan", "StepBatch", "attend", "attention", "paged_decode", "plan_chunks",
           "select_backend", "window_mask"]

_MHA = MHA()


def attention(layer: int, q: torch.Tensor, new: list[torch.Tensor], meta: AttentionMetadata, scale: float,
              window: int | None, math) -> torch.Tensor:
    """Write the layer's new entries (K and V, or a latent) and attend with its group's backend (no
    cache: over the span's own rows)."""
    return (meta.backends or NO_CACHE).attend(layer, q, new, meta, scale, window, math)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata,
           scale: float, window: int | None = None) -> torch.Tensor:
    """Multi-head attention: q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> out [T, Hq, D]."""
    for observe in meta.observers:
        observe(layer, q, k, v, scale, window)
    return attention(layer, q, [k, v], meta, scale, window, _MHA)
