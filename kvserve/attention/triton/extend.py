"""Paged prefill/extend: each request's new tokens (a prefill chunk) attend over its cached prefix
and themselves, all read from the pool by block table (the chunk's own K/V are written first).

One program per (request, tile of BLOCK_M new tokens, KV head); its rows are the tile's tokens
times the G query heads of that KV head, so a block is read once for all of them. Keys run from
the tile's first visible position (sliding windows skip whole blocks) to its last query; the mask
is causal, and windowed when a window is given. Formats: native, int8 and fp8 (dequantized in
registers); KIVI chunks keep the torch path (their queries see their own block exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.decode import NEG, tile_tokens
from kvserve.attention.triton.source import FP8_E4M3, FP8_E5M2, INT8, NATIVE, KVSource, load_tile

EXTENDABLE = (NATIVE, INT8, FP8_E4M3, FP8_E5M2)


@triton.jit
def _extend_kernel(q, out, q_start, q_len, ctx_len, table, kd, ks, kz, kr, vd, vs, vz, vr, sm_scale,
                   table_stride, window, HQ, HKV, G, KW, KD, VW, VD,
                   BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr,
                   BLOCK_DV: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, PAGES: tl.constexpr):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    n = tl.load(q_len + r)
    if tile * BLOCK_M >= n:
        return
    ctx = tl.load(ctx_len + r)
    first = tl.load(q_start + r)
    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    i = tile * BLOCK_M + rows // BLOCK_G
    gh = rows % BLOCK_G
    ok = (i < n) & (gh < G)
    qpos = ctx - n + i
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    t = tl.arange(0, PAGES * BS)          # a tile spans PAGES blocks
    off = t % BS
    qrow = (first + i).to(tl.int64) * HQ + h * G + gh
    qv = tl.load(q + qrow[:, None] * KD + dk[None, :], mask=ok[:, None] & (dk < KD)[None, :],
                 other=0.0).to(tl.float32)
    lo_pos = ctx - n + tile * BLOCK_M
    hi_pos = ctx - n + tl.minimum(n, (tile + 1) * BLOCK_M)     # one past the tile's last query
    lo = tl.where(window > 0, tl.maximum(lo_pos - window + 1, 0), 0)
    m = tl.full([BLOCK_M * BLOCK_G], NEG, tl.float32)
    l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
    p_end = (hi_pos - 1) // BS + 1
    for p in range(lo // BS, p_end, PAGES):
        page = p + t // BS
        live = page < p_end
        blk = tl.load(table + r.to(tl.int64) * table_stride + page, mask=live, other=0)
        kpos = page * BS + off
        valid = live & (kpos >= lo) & (kpos < hi_pos)
        k = load_tile(kd, ks, kz, kr, blk, off, off, off < 0, dk, h, HKV, KW, KD, valid, dk < KD,
                      BS, K_FMT, 8, 1)
        v = load_tile(vd, vs, vz, vr, blk, off, off, off < 0, dv, h, HKV, VW, VD, valid, dv < VD,
                      BS, V_FMT, 8, 1)
        sc = tl.dot(qv, tl.trans(k), input_precision="ieee") * sm_scale
        visible = valid[None, :] & (kpos[None, :] <= qpos[:, None]) & \
            ((window <= 0) | (kpos[None, :] > qpos[:, None] - window))
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        m = m_new
    o = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out + qrow[:, None] * VD + dv[None, :], o, mask=ok[:, None] & (dv < VD)[None, :])


def paged_extend(q: torch.Tensor, k: KVSource, v: KVSource, table: torch.Tensor, q_start: torch.Tensor,
                 q_len: torch.Tensor, ctx_len: torch.Tensor, scale: float, window: int | None = None,
                 block_m: int = 16, max_len: int | None = None) -> torch.Tensor:
    """q [T, Hq, KD]: request r's new tokens are rows [q_start[r], q_start[r] + q_len[r]), at positions
    ctx_len[r] - q_len[r] ... ctx_len[r] - 1 of table row r ([R, W] block ids) -> [T, Hq, VD].
    `max_len` (the longest q_len, when the caller knows it) saves a device-to-host read."""
    if k.fmt not in EXTENDABLE or v.fmt not in EXTENDABLE:
        raise ValueError("paged_extend reads native, int8 and fp8 caches")
    t, hq, kd = q.shape
    hkv, bs, vd = k.heads, k.data.shape[1], v.dim
    q = q.contiguous()
    g = hq // hkv
    block_g = triton.next_power_of_2(g)
    longest = int(q_len.max()) if max_len is None else max_len
    block_m = max(1, min(block_m, triton.next_power_of_2(longest), 64 // block_g))
    block_m = max(block_m, -(-16 // block_g))                      # tl.dot wants at least 16 rows
    out = torch.empty((t, hq, vd), dtype=torch.float32, device=q.device)
    tiles = -(-longest // block_m)
    i32 = [x.to(torch.int32).contiguous() for x in (q_start, q_len, ctx_len, table)]
    _extend_kernel[(len(q_len), tiles, hkv)](
        q, out, *i32[:3], i32[3], *k.args(), *v.args(), scale, i32[3].stride(0), window or 0,
        hq, hkv, g, k.width, kd, v.width, vd, BS=bs, BLOCK_M=block_m, BLOCK_G=block_g,
        BLOCK_DK=max(16, triton.next_power_of_2(kd)), BLOCK_DV=max(16, triton.next_power_of_2(vd)),
        K_FMT=k.fmt, V_FMT=v.fmt, PAGES=max(1, tile_tokens(kd) // bs))
    return out.to(q.dtype)
