"""Attention over the paged KV cache (torch reference backend) and over no cache at all."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kv.storage import KVStorage


@dataclass
class PrefillSpan:
    """One request whose new tokens are not a single decode token."""

    start: int            # first row of its tokens in the flat batch
    num_tokens: int       # new tokens this step
    context_len: int      # cached + new tokens it attends over
    slot_idx: torch.Tensor | None = None  # [context_len] cache slots of its whole context
    mask: torch.Tensor | None = None      # [num_tokens, context_len] bool, None when causal from 0


@dataclass
class AttentionMetadata:
    """What attention needs to know about the flat batch of tokens."""

    slot_mapping: torch.Tensor | None       # [num_tokens] where new K/V go; None without a cache
    num_decodes: int = 0                    # decode rows come first in the flat batch
    decode_slot_idx: torch.Tensor | None = None  # [num_decodes, max_context] cache slots (padded)
    decode_mask: torch.Tensor | None = None      # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillSpan] = field(default_factory=list)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
           storage: KVStorage | None, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens -> out [T, Hq, D]."""
    if storage is not None:
        storage.write(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode(q[:meta.num_decodes], layer, storage, meta, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if storage is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = storage.read(layer, span.slot_idx)
        out[rows] = _prefill(q[rows], ks, vs, span.mask, scale)
    return out


def _decode(q, layer, storage, meta, scale):
    ks, vs = storage.read(layer, meta.decode_slot_idx)  # [B, L, Hkv, D]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),                                   # [B, Hq, 1, D]
        ks.transpose(1, 2), vs.transpose(1, 2),           # [B, Hkv, L, D]
        attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _prefill(q, k, v, mask, scale):
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
