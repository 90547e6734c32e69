"""Decode attention over native K/V blocks, read from the pool by block id (torch reference).

Each decode row attends over the positions [start, end) of its block table. The visible blocks are
cut into chunks of up to `per` blocks; one fused attention call covers every (row, chunk) pair, with
the query heads of each K/V head as the query rows of that head (no head attends to another's
keys, nothing is repeated). Chunks of one row are then combined exactly through their
log-sum-exps. When the rows' lengths are close, each row is one chunk and nothing is combined.
"""

from __future__ import annotations

import torch

from kvserve.attention.math import attention_lse
from kvserve.attention.metadata import DecodeChunks

# A single padded chunk per row is used while padding adds at most this share of blocks.
PAD_SLACK = 1.25


def plan_chunks(table: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, block_size: int,
                blocks_per_chunk: int) -> DecodeChunks:
    """Row i of `table` [B, W] (block ids) attends over positions [starts[i], ends[i]): its visible
    blocks in chunks, positions outside the range (and chunk padding) masked with -inf."""
    bs = block_size
    b0 = starts // bs
    b1 = torch.div(ends - 1, bs, rounding_mode="floor") + 1
    n = b1 - b0                                                             # [B] visible blocks
    rows = n.numel()
    longest, total = int(n.max()), int(n.sum())
    per = longest if rows * longest <= PAD_SLACK * total else min(blocks_per_chunk, longest)
    chunks = torch.div(n + per - 1, per, rounding_mode="floor")             # [B]
    row = torch.repeat_interleave(torch.arange(rows, device=table.device), chunks)   # [P]
    first = torch.cumsum(chunks, 0) - chunks
    j = torch.arange(row.numel(), device=table.device) - first[row]         # chunk index within its row
    col = (b0[row] + j * per)[:, None] + torch.arange(per, device=table.device)[None, :]   # [P, per]
    blocks = table[row[:, None], torch.minimum(col, (b1 - 1)[row][:, None])]
    pos = (col[:, :, None] * bs + torch.arange(bs, device=table.device)).flatten(1)         # [P, per * bs]
    hidden = (pos < starts[row][:, None]) | (pos >= ends[row][:, None])
    bias = torch.zeros(pos.shape, device=table.device).masked_fill_(hidden, float("-inf"))
    return DecodeChunks(blocks.flatten(), row, bias[:, None, None, :], rows, row.numel() == rows)


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, chunks: DecodeChunks,
                 scale: float) -> torch.Tensor:
    """One query token per row over its blocks in the pools [num_blocks, block_size, Hkv, D]:
    q [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    num, hkv = chunks.row.numel(), k_pool.shape[2]
    span = chunks.bias.shape[-1]
    k_out, v_out = chunks.workspace if chunks.workspace is not None else (None, None)
    keys = torch.index_select(k_pool, 0, chunks.blocks, out=k_out).view(num, span, hkv, d).transpose(1, 2)
    values = torch.index_select(v_pool, 0, chunks.blocks, out=v_out).view(num, span, hkv, d).transpose(1, 2)
    keys, values = keys.to(q.dtype), values.to(q.dtype)   # bfloat16 pools under float32 queries
    qp = q if chunks.one_per_row else q.index_select(0, chunks.row)
    out, lse = attention_lse(qp.view(num, hkv, hq // hkv, d), keys, values, chunks.bias, scale)
    if chunks.one_per_row:
        return out.reshape(b, hq, d)
    lse = lse.reshape(num, hq)
    row = chunks.row
    peak = lse.new_full((b, hq), float("-inf")).scatter_reduce_(0, row[:, None].expand(-1, hq), lse, "amax")
    w = torch.exp(lse - peak.index_select(0, row))                                    # [P, Hq]
    total = w.new_zeros(b, hq).index_add_(0, row, w)
    acc = w.new_zeros(b, hq, d).index_add_(0, row, out.reshape(num, hq, d).float() * w.unsqueeze(-1))
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def paged_decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     slot: torch.Tensor, blocks: torch.Tensor, span: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token, traceable (the compiled one-token stack, model/regions.py): write its K/V
    [1, Hkv, D] at `slot` [1], attend over `blocks` [n] of the pools, of whose n * block_size
    positions [span[0], span[1]) are visible, each K/V head's query heads as its query rows;
    q [1, Hq, D] -> [1, Hq, Dv]. n is an unbacked size in the graph (one_token_blocks)."""
    bs, hkv, d = k_pool.shape[1:]
    dv = v_pool.shape[-1]
    torch._check(blocks.shape[0] >= 1)
    write_one(k, v, k_pool, v_pool, slot)
    # pools may be bfloat16 under float32 queries: widened as they are read
    keys = k_pool.index_select(0, blocks).to(q.dtype).view(-1, hkv, d).permute(1, 2, 0)      # [Hkv, D, L]
    values = v_pool.index_select(0, blocks).to(q.dtype).view(-1, hkv, dv).transpose(0, 1)    # [Hkv, L, Dv]
    pos = torch.arange(blocks.shape[0] * bs, device=q.device)
    bias = torch.zeros((), device=q.device).masked_fill((pos < span[0]) | (pos >= span[1]), float("-inf"))
    hq = q.shape[1]
    scores = torch.matmul(q.view(hkv, hq // hkv, d), keys) * scale + bias
    weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.matmul(weights, values).view(1, hq, dv)


@torch.library.custom_op("kvserve::write_one", mutates_args=("k_pool", "v_pool"))
def write_one(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              slot: torch.Tensor) -> None:
    """Store one token's K and V [1, Hkv, D] at `slot` [1] of the pools, in the pools' dtype. An op
    that mutates the pools, so that the one-token graph writes them in place: traced, a pool written
    by several layers (KV groups sharing a slot) is copied whole and written back."""
    k_pool.view(-1, *k_pool.shape[2:]).index_put_((slot,), k.to(k_pool.dtype))
    v_pool.view(-1, *v_pool.shape[2:]).index_put_((slot,), v.to(v_pool.dtype))


def one_token_blocks(table: torch.Tensor, start: int, end: int, block_size: int,
                     mark: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_decode_one's (blocks, span) for positions [start, end) of a block table row: the
    blocks that hold them, their length marked unbacked (unless `mark` is False: for the native
    decode stack, which no graph traces), so that the one-token graph holds no guard on it (a
    backed size there gets one: Inductor's CPU reductions switch to a cascade sum past 4096
    elements and guard on that, recompiling the graph as a stream crosses it)."""
    b0 = start // block_size
    blocks = table[b0:(end - 1) // block_size + 1].clone()   # its own storage: no offset to guard on
    if mark:
        torch._dynamo.decorators.mark_unbacked(blocks, 0)
    lo = b0 * block_size
    return blocks, torch.tensor([start - lo, end - lo], device=table.device)
