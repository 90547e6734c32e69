"""Paged decode: one query token per row over the blocks of its block table, read in place.

One program per (row, KV head, split): the G = Hq / Hkv query heads of a KV head are the rows of
one tile, so each block is read once for all of them (up to 16 heads a program; MQA and MLA with
more heads take a few programs per KV head). A program walks its blocks with an online
softmax, a tile of about 64 keys (several blocks, each by its id) at a time. Long contexts are cut
into splits (flash-decoding): each split writes a partial output and its log-sum-exp, and a second
kernel combines them exactly. Positions before
`start` (a sliding window) or from `end` on are masked. K and V may be in any format of
source.py, dequantized in registers; an MLA latent is K and (its first `rank` columns) V at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.source import KVSource, dot_dtype, load_kv, mma

NEG = -1.0e30  # running max before any key: finite, so exp(m_old - m_new) never sees inf - inf
MAX_HEADS = 16  # query heads per program; more (MQA, MLA) take more programs over the same keys


@triton.jit
def _decode_kernel(q, out, part_o, part_lse, table, starts, ends, row_of_block, sealed,
                   kd, ks, kz, kr, vd, vs, vz, vr, sm_scale, table_stride,
                   HQ, HKV, G, KW, KD, VW, VD, pages_per_split, num_splits,
                   BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   K_FMT: tl.constexpr, V_FMT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                   V_GROUP: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, PAGES: tl.constexpr,
                   DT: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)                   # KV head x block of its query heads
    s = tl.program_id(2)
    HB = tl.cdiv(G, BLOCK_G)
    h = hb // HB
    start = tl.load(starts + b)
    end = tl.load(ends + b)
    p0 = start // BS + s * pages_per_split
    p1 = tl.minimum(p0 + pages_per_split, (end - 1) // BS + 1)
    own = (end - 1) // BS                   # the block the query's own token is in (KIVI)
    g = (hb % HB) * BLOCK_G + tl.arange(0, BLOCK_G)   # query heads of KV head h, G in all
    heads = h * G + g
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    t = tl.arange(0, PAGES * BS)          # a tile spans PAGES blocks
    off = t % BS
    qv = tl.load(q + (b * HQ + heads)[:, None] * KD + dk[None, :],
                 mask=(g < G)[:, None] & (dk < KD)[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], NEG, tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for p in range(p0, p1, PAGES):
        page = p + t // BS
        live = page < p1
        blk = tl.load(table + b.to(tl.int64) * table_stride + page, mask=live, other=0)
        pos = page * BS + off
        visible = live & (pos >= start) & (pos < end)
        k, v, row = load_kv(kd, ks, kz, kr, vd, vs, vz, vr, row_of_block, sealed, blk, page, own, live, off, visible,
                            dk, dv, h, HKV, KW, KD, VW, VD, BS, K_FMT, V_FMT, K_BITS, V_BITS, V_GROUP, RESIDUAL)
        sc = mma(qv, tl.trans(k), DT) * sm_scale          # [BLOCK_G, tile]
        sc = tl.where(visible[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        den = den * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + mma(pr, v, DT)
        m = m_new
    omask = (g < G)[:, None] & (dv < VD)[None, :]
    if SPLIT:
        at = (b * HQ + heads) * num_splits + s
        tl.store(part_o + at[:, None] * VD + dv[None, :], acc / tl.maximum(den, 1e-30)[:, None], mask=omask)
        tl.store(part_lse + at, tl.where(den > 0, m + tl.log(tl.maximum(den, 1e-30)), float("-inf")), mask=g < G)
    else:
        tl.store(out + (b * HQ + heads)[:, None] * VD + dv[None, :], acc / den[:, None], mask=omask)


@triton.jit
def _combine_kernel(part_o, part_lse, out, num_splits, VD, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out[r] = sum_s exp(lse_s - lse) o_s over the splits of row-head r (exact softmax merge)."""
    r = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(part_lse + r * num_splits + s, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(s < num_splits, tl.exp(lse - top), 0.0)
    o = tl.load(part_o + (r * num_splits + s)[:, None] * VD + dv[None, :],
                mask=(s < num_splits)[:, None] & (dv < VD)[None, :], other=0.0)
    tl.store(out + r * VD + dv, tl.sum(o * w[:, None], 0) / tl.sum(w, 0), mask=dv < VD)


def num_splits_for(rows: int, kv_heads: int, max_pages: int, device: torch.device, min_pages: int = 8) -> int:
    """Splits per row so that rows x KV heads x splits fills the GPU about twice over, each split
    reading at least `min_pages` blocks; 1 on a CPU (the interpreter gains nothing)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, rows * kv_heads))
    return max(1, min(want, max_pages // min_pages, 64))


def tile_tokens(dim: int) -> int:
    """Keys per tile: 64, fewer for wider vectors (MLA latents: 16), to bound a tile's registers."""
    return 64 if dim <= 128 else 32 if dim <= 256 else 16


def _pow2(n: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(n))


def paged_decode(q: torch.Tensor, k: KVSource, v: KVSource, table: torch.Tensor, starts: torch.Tensor,
                 ends: torch.Tensor, scale: float, num_splits: int | None = None,
                 row_of_block: torch.Tensor | None = None, sealed: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, KD] over positions [starts[b], ends[b]) of table row b ([B, W] block ids) ->
    [B, Hq, VD] in q's dtype. KIVI sources need the storage's `row_of_block` and `sealed`."""
    b, hq, kd = q.shape
    hkv, bs = k.heads, k.data.shape[1]
    vd = v.dim
    q = q.contiguous()
    table = table.to(torch.int32).contiguous()
    starts, ends = starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()
    max_pages = table.shape[1]
    pages = max(1, tile_tokens(kd) // bs)
    splits = num_splits or num_splits_for(b, hkv, max_pages, q.device)
    per = -(-max_pages // splits)
    per = -(-per // pages) * pages                     # whole tiles per split
    splits = -(-max_pages // per)
    res = k.residual is not None or v.residual is not None
    rob = row_of_block if res else table
    sl = sealed.view(torch.uint8) if res else table
    o32 = torch.empty((b, hq, vd), dtype=torch.float32, device=q.device)
    part_o = torch.empty((b, hq, splits, vd), dtype=torch.float32, device=q.device) if splits > 1 else o32
    part_lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device) if splits > 1 else o32
    g = hq // hkv
    block_g = min(_pow2(g), MAX_HEADS)
    _decode_kernel[(b, hkv * -(-g // block_g), splits)](
        q, o32, part_o, part_lse, table, starts, ends, rob, sl, *k.args(), *v.args(), scale, table.stride(0),
        hq, hkv, hq // hkv, k.width, kd, v.width, vd, per, splits,
        BS=bs, BLOCK_G=block_g, BLOCK_DK=_pow2(kd), BLOCK_DV=_pow2(vd), K_FMT=k.fmt, V_FMT=v.fmt,
        K_BITS=k.bits, V_BITS=v.bits, V_GROUP=v.vgroup, RESIDUAL=res, SPLIT=splits > 1, PAGES=pages,
        DT=dot_dtype(q.dtype))
    if splits > 1:
        _combine_kernel[(b * hq,)](part_o, part_lse, o32, splits, vd, BLOCK_S=_pow2(splits, 2),
                                   BLOCK_DV=_pow2(vd))
    result = o32.to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
