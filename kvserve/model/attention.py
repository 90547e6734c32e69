"""Attention over the paged KV cache (torch reference backend) or over no cache at all."""

from __future__ import annotations

import math
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
class PagedDecode:
    """The decode rows of one KV group as a ragged list of (row, chunk) pairs, a chunk being up to
    `blocks_per_chunk` consecutive blocks of one row: attention reads the blocks straight from the
    pool, with no padding to the longest context (see `paged_decode`)."""

    blocks: torch.Tensor     # [P * blocks_per_chunk] block ids, chunk by chunk (a short last chunk is padded)
    row: torch.Tensor        # [P] the decode row each chunk belongs to
    bias: torch.Tensor       # [P, 1, 1, blocks_per_chunk * block_size] float32: 0 visible, -inf not
    # Reused output buffers for the gathered K and V blocks ([P * blocks_per_chunk, *block shape]):
    # a fresh tens-of-MB tensor per layer would be mmapped and page-faulted in at every call.
    workspace: list[torch.Tensor] | None = None


def paged_decode_plan(tables: list[torch.Tensor], starts: list[int], ends: list[int], block_size: int,
                      blocks_per_chunk: int) -> PagedDecode:
    """Decode row i attends over positions [starts[i], ends[i]) of the blocks in tables[i]:
    cut its visible blocks into chunks, pad the last chunk with a repeat of its first block, and
    mask every slot outside the range (the unwritten tail, out-of-window positions, padding)."""
    bs, per = block_size, blocks_per_chunk
    device = tables[0].device
    blocks, rows, first = [], [], []
    for i, (table, start, end) in enumerate(zip(tables, starts, ends)):
        b0, b1 = start // bs, (end - 1) // bs + 1
        chunks = -(-(b1 - b0) // per)
        visible = table[b0:b1]
        blocks.append(torch.cat([visible, visible[:1].expand(chunks * per - len(visible))]))
        rows += [i] * chunks
        first += range(b0 * bs, (b0 + chunks * per) * bs, per * bs)
    row = torch.tensor(rows, dtype=torch.long, device=device)
    pos = torch.tensor(first, device=device)[:, None] + torch.arange(per * bs, device=device)[None, :]
    lo = torch.tensor(starts, device=device)[row][:, None]
    hi = torch.tensor(ends, device=device)[row][:, None]
    bias = torch.zeros(pos.shape, device=device).masked_fill_((pos < lo) | (pos >= hi), -math.inf)
    return PagedDecode(torch.cat(blocks), row, bias[:, None, None, :])


@dataclass
class GroupView:
    """Where one KV group's layers write and read this step."""

    slot_mapping: torch.Tensor                 # [num_tokens] slots of the new tokens
    decode_idx: torch.Tensor | None = None     # [num_decodes, L] slots each decode attends over (padded)
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, L] bool
    prefill_idx: list[torch.Tensor] = field(default_factory=list)          # per span: [ctx_g] slots
    prefill_mask: list[torch.Tensor | None] = field(default_factory=list)  # per span: [n, ctx_g] or None = causal
    paged: PagedDecode | None = None           # the decode rows' blocks, for native K/V layers


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
    batched: bool                 # True for the decode batch
    paged: PagedDecode | None = None  # set: entries are the whole K and V pools [num_blocks, block_size, Hkv, D]


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
    pools = storage.native_kv(layer) if view.paged is not None and meta.score_hook is None else None
    if meta.num_decodes and pools is not None:
        out.append(Context(slice(0, meta.num_decodes), pools, None, True, view.paged))
    elif meta.num_decodes:
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
        if ctx.paged is not None:
            out[ctx.rows] = paged_decode(q[ctx.rows], ks, vs, ctx.paged, scale)
        elif ctx.batched:
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


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, paged: PagedDecode,
                 scale: float) -> torch.Tensor:
    """One query token per row over its blocks in the pool: q [B, Hq, D] -> [B, Hq, D].

    Scores are computed chunk by chunk for the ragged (row, chunk) pairs, so no row pays for the
    longest context and nothing is gathered token by token. Within a chunk, one matmul scores every
    query head against every KV head ([span * Hkv, D] x [D, Hq]) and the matching KV head's scores
    are kept: a few wasted multiply-adds buy one dense matmul instead of many tiny ones. The
    softmax is exact: the per-row maximum is taken over all of the row's chunks before
    exponentiating, and per-chunk partial sums are added up per row."""
    b, hq, d = q.shape
    num, hkv = paged.row.numel(), k_pool.shape[2]
    g, span = hq // hkv, paged.bias.shape[-1]
    k_out, v_out = paged.workspace if paged.workspace is not None else (None, None)
    keys = torch.index_select(k_pool, 0, paged.blocks, out=k_out).view(num, span * hkv, d)
    values = torch.index_select(v_pool, 0, paged.blocks, out=v_out).view(num, span, hkv * d)
    qp = q.index_select(0, paged.row).transpose(1, 2)                               # [P, D, Hq]
    cross = torch.bmm(keys, qp).view(num, span, hkv, hkv, g).diagonal(0, 2, 3)      # [P, span, G, Hkv]
    s = torch.add(paged.bias, cross.permute(0, 3, 2, 1), alpha=scale)               # [P, Hkv, G, span] float32
    row = paged.row.view(-1, 1, 1).expand(-1, hkv, g)
    peak = s.new_full((b, hkv, g), -math.inf).scatter_reduce(0, row, s.amax(-1), "amax")
    e = torch.exp(s - peak.index_select(0, paged.row).unsqueeze(-1))                 # [P, Hkv, G, span]
    total = e.new_zeros(b, hq).index_add_(0, paged.row, e.sum(-1).view(num, hq))
    part = torch.bmm(e.to(v_pool.dtype).view(num, hq, span), values)                # [P, Hq, Hkv * D]
    part = part.view(num, hkv, g, hkv, d).diagonal(0, 1, 3).permute(0, 3, 1, 2)     # [P, Hkv, G, D]
    out = e.new_zeros(b, hq * d).index_add_(0, paged.row, part.reshape(num, hq * d).float())
    return (out.view(b, hq, d) / total.unsqueeze(-1)).to(q.dtype)


def _prefill(q, k, v, mask, scale):
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
