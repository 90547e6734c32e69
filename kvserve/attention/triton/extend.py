"""Paged prefill/extend: each request's new tokens (a prefill chunk) attend over its cached prefix
and themselves, all read from the pool by block table (the chunk's own K/V are written first).

One program per (request, tile of BLOCK_M new tokens, KV head); its rows are the tile's tokens
times the G query heads of that KV head, so a block is read once for all of them. Keys run from
the tile's first visible position (sliding windows skip whole blocks) to its last query; the mask
is causal, and windowed when a window is given. Every format of source.py is read in place.

KIVI (formats.py): a query sees earlier blocks as stored (packed, or the residual row of a block
still filling) and the earlier tokens of its own block exact: from the chunk's fresh entries for
positions of this chunk, from the block's residual row before it. Each tile is then read both
ways and every (query, key) pair takes the view its blocks call for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.decode import MAX_HEADS, NEG, tile_tokens
from kvserve.attention.triton.source import KIVI_K, KVSource, dot_dtype, load_kv, mma


@triton.jit
def _exact_tile(fresh, res, row, off, kpos, q0, first, valid, d, head, H, W, dmask, BS: tl.constexpr,
                FMT: tl.constexpr, stored):
    """KIVI: keys at `kpos` as their own block's queries see them (fresh rows from position q0 on,
    the residual row before; `valid` keys only, 0 elsewhere); other formats: as stored."""
    if FMT >= 4:
        new = valid & (kpos >= q0)
        fvec = (first + kpos - q0).to(tl.int64) * H + head
        x = tl.load(fresh + fvec[:, None] * W + d[None, :], mask=new[:, None] & dmask[None, :], other=0.0)
        old = valid & (kpos < q0) & (row >= 0)
        rvec = (row.to(tl.int64) * BS + off) * H + head
        y = tl.load(res + rvec[:, None] * W + d[None, :], mask=old[:, None] & dmask[None, :], other=0.0)
        return tl.where(new[:, None], x.to(tl.float32), y.to(tl.float32))
    else:
        return stored


@triton.jit
def _extend_kernel(q, out, q_start, q_len, ctx_len, table, row_of_block, sealed, fk, fv,
                   kd, ks, kz, kr, vd, vs, vz, vr, sm_scale, table_stride, window, HQ, HKV, G, KW, KD, VW, VD,
                   BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr,
                   BLOCK_DV: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, K_BITS: tl.constexpr,
                   V_BITS: tl.constexpr, V_GROUP: tl.constexpr, PAGES: tl.constexpr, OWN: tl.constexpr,
                   DT: tl.constexpr):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    hb = tl.program_id(2)                   # KV head x block of its query heads
    HB = tl.cdiv(G, BLOCK_G)
    h = hb // HB
    n = tl.load(q_len + r)
    if tile * BLOCK_M >= n:
        return
    ctx = tl.load(ctx_len + r)
    first = tl.load(q_start + r)
    q0 = ctx - n
    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    i = tile * BLOCK_M + rows // BLOCK_G
    gh = (hb % HB) * BLOCK_G + rows % BLOCK_G
    ok = (i < n) & (gh < G)
    qpos = q0 + i
    own_start = qpos // BS * BS
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    t = tl.arange(0, PAGES * BS)          # a tile spans PAGES blocks
    off = t % BS
    qrow = (first + i).to(tl.int64) * HQ + h * G + gh
    qv = tl.load(q + qrow[:, None] * KD + dk[None, :], mask=ok[:, None] & (dk < KD)[None, :],
                 other=0.0).to(tl.float32)
    lo_pos = q0 + tile * BLOCK_M
    hi_pos = q0 + tl.minimum(n, (tile + 1) * BLOCK_M)     # one past the tile's last query
    lo = tl.where(window > 0, tl.maximum(lo_pos - window + 1, 0), 0)
    m = tl.full([BLOCK_M * BLOCK_G], NEG, tl.float32)
    den = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
    p_end = (hi_pos - 1) // BS + 1
    for p in range(lo // BS, p_end, PAGES):
        page = p + t // BS
        live = page < p_end
        blk = tl.load(table + r.to(tl.int64) * table_stride + page, mask=live, other=0)
        kpos = page * BS + off
        valid = live & (kpos >= lo) & (kpos < hi_pos)
        k, v, row = load_kv(kd, ks, kz, kr, vd, vs, vz, vr, row_of_block, sealed, blk, page, -1, live, off, valid,
                            dk, dv, h, HKV, KW, KD, VW, VD, BS, K_FMT, V_FMT, K_BITS, V_BITS, V_GROUP, OWN)
        visible = valid[None, :] & (kpos[None, :] <= qpos[:, None]) & \
            ((window <= 0) | (kpos[None, :] > qpos[:, None] - window))
        sc = mma(qv, tl.trans(k), DT) * sm_scale
        if OWN:
            own = kpos[None, :] >= own_start[:, None]
            mine = valid & (kpos >= lo_pos // BS * BS)     # keys in some query's own block
            k_exact = _exact_tile(fk, kr, row, off, kpos, q0, first, mine, dk, h, HKV, KW, dk < KD, BS, K_FMT, k)
            v_exact = _exact_tile(fv, vr, row, off, kpos, q0, first, mine, dv, h, HKV, VW, dv < VD, BS, V_FMT, v)
            sc = tl.where(own, mma(qv, tl.trans(k_exact), DT) * sm_scale, sc)
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        den = den * alpha + tl.sum(pr, 1)
        if OWN:
            pv = mma(tl.where(own, 0.0, pr), v, DT) + \
                mma(tl.where(own, pr, 0.0), v_exact, DT)
        else:
            pv = mma(pr, v, DT)
        acc = acc * alpha[:, None] + pv
        m = m_new
    o = acc / tl.maximum(den, 1e-30)[:, None]
    tl.store(out + qrow[:, None] * VD + dv[None, :], o, mask=ok[:, None] & (dv < VD)[None, :])


def paged_extend(q: torch.Tensor, k: KVSource, v: KVSource, table: torch.Tensor, q_start: torch.Tensor,
                 q_len: torch.Tensor, ctx_len: torch.Tensor, scale: float, window: int | None = None,
                 block_m: int = 16, max_len: int | None = None, fresh: list[torch.Tensor] | None = None,
                 row_of_block: torch.Tensor | None = None, sealed: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, KD]: request r's new tokens are rows [q_start[r], q_start[r] + q_len[r]), at positions
    ctx_len[r] - q_len[r] ... ctx_len[r] - 1 of table row r ([R, W] block ids) -> [T, Hq, VD].
    `max_len` (the longest q_len, when the caller knows it) saves a device-to-host read. KIVI
    sources also need the chunk's `fresh` [K, V] rows (as q's) and the storage's `row_of_block`
    and `sealed`."""
    t, hq, kd = q.shape
    hkv, bs, vd = k.heads, k.data.shape[1], v.dim
    q = q.contiguous()
    g = hq // hkv
    block_g = min(triton.next_power_of_2(g), MAX_HEADS)
    longest = int(q_len.max()) if max_len is None else max_len
    block_m = max(1, min(block_m, triton.next_power_of_2(longest), 64 // block_g))
    block_m = max(block_m, -(-16 // block_g))                      # tl.dot wants at least 16 rows
    out = torch.empty((t, hq, vd), dtype=torch.float32, device=q.device)
    tiles = -(-longest // block_m)
    i32 = [x.to(torch.int32).contiguous() for x in (q_start, q_len, ctx_len, table)]
    own = k.fmt >= KIVI_K or v.fmt >= KIVI_K
    if own:
        fk, fv = (x.contiguous() for x in fresh)
        extra = (row_of_block, sealed.view(torch.uint8), fk, fv)
    else:
        extra = (i32[3],) * 4
    _extend_kernel[(len(q_len), tiles, hkv * -(-g // block_g))](
        q, out, *i32[:3], i32[3], *extra, *k.args(), *v.args(), scale, i32[3].stride(0), window or 0,
        hq, hkv, g, k.width, kd, v.width, vd, BS=bs, BLOCK_M=block_m, BLOCK_G=block_g,
        BLOCK_DK=max(16, triton.next_power_of_2(kd)), BLOCK_DV=max(16, triton.next_power_of_2(vd)),
        K_FMT=k.fmt, V_FMT=v.fmt, K_BITS=k.bits, V_BITS=v.bits, V_GROUP=v.vgroup,
        PAGES=max(1, tile_tokens(kd) // bs), OWN=own,
        DT=dot_dtype(q.dtype))
    return out.to(q.dtype)
