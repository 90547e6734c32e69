"""Attention over the paged KV cache (torch reference backend) or over no cache at all."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kv.storage import KVStorage


@dataclass
class PrefillSpan:
    """One request whose new tokens are not a single decode token."""

    start: int          # first row of its tokens in the flat batch
    num_tokens: int     # new tokens this step
    context_len: int    # cached + new tokens


@dataclass
class GroupView:
    """Where one KV group's layers write and read this step."""

    slot_mapping: torch.Tensor                 # [num_tokens] slots of the new tokens
    decode_idx: torch.Tensor | None = None     # [num_decodes, L] slots each decode attends over (padded)
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, L] bool
    prefill_idx: list[torch.Tensor] = field(default_factory=list)          # per span: [ctx_g] slots
    prefill_mask: list[torch.Tensor | None] = field(default_factory=list)  # per span: [n, ctx_g] or None = causal


@dataclass
class AttentionMetadata:
    """What attention needs to know about the flat batch (decode rows come first)."""

    num_decodes: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    groups: list[GroupView] | None = None      # None: no cache, every span attends over its own rows


@dataclass
class Context:
    """Rows of the flat batch and the cached entries (K, V or latent) they attend over."""

    rows: slice
    entries: list[torch.Tensor]   # decode: [B, L, ...]; prefill: [ctx, ...]
    mask: torch.Tensor | None
    batched: bool                 # True for the padded decode batch


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility [len(q_pos), len(k_pos)]."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def contexts(layer: int, storage: KVStorage | None, meta: AttentionMetadata,
             new: list[torch.Tensor], window: int | None = None) -> list[Context]:
    """Write this layer's new entries to the cache, then list what each row range attends over."""
    if meta.groups is None:
        return [_uncached(span, new, window) for span in meta.prefills]
    view = meta.groups[storage.layer_group[layer]]
    storage.write(layer, view.slot_mapping, *new)
    out = []
    if meta.num_decodes:
        out.append(Context(slice(0, meta.num_decodes), storage.read(layer, view.decode_idx),
                           view.decode_mask, True))
    for span, idx, mask in zip(meta.prefills, view.prefill_idx, view.prefill_mask):
        out.append(Context(slice(span.start, span.start + span.num_tokens), storage.read(layer, idx), mask, False))
    return out


def _uncached(span: PrefillSpan, new: list[torch.Tensor], window: int | None) -> Context:
    rows = slice(span.start, span.start + span.num_tokens)
    mask = None
    if window is not None and span.num_tokens > window:
        pos = torch.arange(span.num_tokens, device=new[0].device)
        mask = window_mask(pos, pos, window)
    return Context(rows, [x[rows] for x in new], mask, False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, storage: KVStorage | None,
           meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens -> out [T, Hq, D]."""
    out = torch.empty_like(q)
    for ctx in contexts(layer, storage, meta, [k, v], window):
        ks, vs = ctx.entries
        if ctx.batched:
            out[ctx.rows] = _decode(q[ctx.rows], ks, vs, ctx.mask, scale)
        else:
            out[ctx.rows] = _prefill(q[ctx.rows], ks, vs, ctx.mask, scale)
    return out


def _decode(q, ks, vs, mask, scale):
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),                                   # [B, Hq, 1, D]
        ks.transpose(1, 2), vs.transpose(1, 2),           # [B, Hkv, L, D]
        attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _prefill(q, k, v, mask, scale):
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
