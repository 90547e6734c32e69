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
    # KV eviction (engine/eviction.py): called as score_hook(layer, ctx, q[ctx.rows], keys, scale) for
    # every context, so H2O / SnapKV can see the attention their requests' cached entries receive.
    score_hook: object | None = None


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
    own = storage.has_own_block_view(layer)  # KIVI: a query sees its own block's keys exact
    out = []
    if meta.num_decodes:
        own_blocks = view.slot_mapping[:meta.num_decodes] // storage.block_size if own else None
        out.append(Context(slice(0, meta.num_decodes), storage.read(layer, view.decode_idx, own_blocks),
                           view.decode_mask, True))
    for span, idx, mask in zip(meta.prefills, view.prefill_idx, view.prefill_mask):
        rows = slice(span.start, span.start + span.num_tokens)
        if own:
            out.append(_own_block_context(layer, storage, span, idx, [x[rows] for x in new], window))
        else:
            out.append(Context(rows, storage.read(layer, idx), mask, False))
    return out


def _own_block_context(layer: int, storage: KVStorage, span: PrefillSpan, idx: torch.Tensor,
                       fresh: list[torch.Tensor], window: int | None) -> Context:
    """A prefill chunk over a KIVI cache: each query sees earlier blocks as stored (quantized) and
    its own block's tokens exact, as a decode step would, so results do not depend on chunking."""
    bs = storage.block_size
    ctx, n = span.context_len, span.num_tokens
    q0, k0 = ctx - n, ctx - idx.numel()
    b0 = max(k0, q0 // bs * bs)                       # first position some query needs exact
    stored = storage.read(layer, idx)                 # [ctx - k0, ...] each
    exact = storage.exact_view(layer, idx[q0 - k0:], fresh)
    if b0 < q0:
        exact = [torch.cat([o, x]) for o, x in zip(storage.exact_view(layer, idx[b0 - k0:q0 - k0]), exact)]
    dev = idx.device
    q_pos, k_pos, e_pos = (torch.arange(a, ctx, device=dev) for a in (q0, k0, b0))
    own_start = (q_pos // bs * bs)[:, None]
    mask = torch.cat([window_mask(q_pos, k_pos, window) & (k_pos[None, :] < own_start),
                      window_mask(q_pos, e_pos, window) & (e_pos[None, :] >= own_start)], dim=1)
    return Context(slice(span.start, span.start + n), [torch.cat([s, x]) for s, x in zip(stored, exact)],
                   mask, False)


def _uncached(span: PrefillSpan, new: list[torch.Tensor], window: int | None) -> Context:
    rows = slice(span.start, span.start + span.num_tokens)
    mask = None
    if window is not None and span.num_tokens > window:
        pos = torch.arange(span.num_tokens, device=new[0].device)
        mask = window_mask(pos, pos, window)
    return Context(rows, [x[rows] for x in new], mask, False)


# Callbacks (layer, q, k, v, scale, window) that see every attend() call: KV calibration uses this.
OBSERVERS: list = []


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, storage: KVStorage | None,
           meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens -> out [T, Hq, D]."""
    for observe in OBSERVERS:
        observe(layer, q, k, v, scale, window)
    rot = storage.rotation(layer) if storage is not None and meta.groups is not None else None
    if rot is not None:  # orthonormal: q k^T unchanged; the cache sees k H and v H (formats.py)
        q, k, v = q @ rot, k @ rot, v @ rot
    out = torch.empty_like(q)
    for ctx in contexts(layer, storage, meta, [k, v], window):
        ks, vs = ctx.entries
        if ctx.batched:
            out[ctx.rows] = _decode(q[ctx.rows], ks, vs, ctx.mask, scale)
        else:
            out[ctx.rows] = _prefill(q[ctx.rows], ks, vs, ctx.mask, scale)
        if meta.score_hook is not None:
            meta.score_hook(layer, ctx, q[ctx.rows], ks, scale)
    return out if rot is None else out @ rot.mT


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
