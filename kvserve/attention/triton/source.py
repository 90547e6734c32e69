"""What a kernel reads for one KV entry (K, V or the MLA latent): its tensors in one format, and
the @triton.jit helper that loads one block's tile of it as float32, dequantized in registers.

Layouts are those of kvserve/kv/formats.py, every tensor contiguous, indexed by block id first:
- native: data [NB, BS, H, W] floats (W = the vector width);
- int8 / fp8: data [NB, BS, H, W] int8 / raw fp8 bytes, scale [NB, BS, H, 1] float16;
- KIVI keys: data [NB, BS, H, W*bits/8] codes, scale and zero [NB, BS/32, H, W] float16 (per channel
  over 32 tokens); KIVI values: the same codes, scale and zero [NB, BS, H, W/VG] (per token over
  VG channels); the still-filling block of a KIVI entry reads its residual row [rows, BS, H, W].
An MLA latent is [NB, BS, W] (H = 1); its value view reads the first `dim` < W columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kv.formats import (
    KIVI_GROUP,
    Fp8Codec,
    Int8Codec,
    KiviKeyCodec,
    KiviValueCodec,
    NativeCodec,
)

NATIVE, INT8, FP8_E4M3, FP8_E5M2, KIVI_K, KIVI_V = range(6)
# The dtype tile products run in: float32 models in float32 (exact FMA), 16-bit models on tensor
# cores in their own dtype with float32 accumulation, as flash attention does.
DOT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass
class KVSource:
    """One entry of one layer as a kernel sees it (see the module docstring for the layouts)."""

    fmt: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    residual: torch.Tensor | None = None   # KIVI: [rows, BS, H, W] in the model dtype
    heads: int = 1
    width: int = 0      # elements per stored vector (before packing)
    dim: int = 0        # leading elements the kernel reads (width, or the MLA rank for values)
    bits: int = 8
    vgroup: int = 1     # KIVI values: channels per scale group

    def args(self) -> tuple:
        """Pointers for the kernel: data, scale, zero, residual (the data again where absent)."""
        d = self.data
        return (d, d if self.scale is None else self.scale, d if self.zero is None else self.zero,
                d if self.residual is None else self.residual)

    def value_view(self, dim: int) -> KVSource:
        """The first `dim` columns of each vector (MLA: the latent's c_kv part serves as V)."""
        return KVSource(self.fmt, self.data, self.scale, self.zero, self.residual, self.heads, self.width,
                        dim, self.bits, self.vgroup)


def source_of(codec, tensors: list[torch.Tensor], residual: torch.Tensor | None = None) -> KVSource | None:
    """The KVSource of an entry kept by `codec` in `tensors`; None for a codec no kernel reads."""
    shape = codec.shape
    heads, width = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    base = dict(heads=heads, width=width, dim=width)
    if isinstance(codec, NativeCodec):
        return KVSource(NATIVE, tensors[0], **base)
    if isinstance(codec, Int8Codec):
        return KVSource(INT8, tensors[0], tensors[1], **base)
    if isinstance(codec, Fp8Codec):
        fmt = FP8_E4M3 if codec.fp8 == torch.float8_e4m3fn else FP8_E5M2
        return KVSource(fmt, tensors[0], tensors[1], **base)
    if isinstance(codec, KiviKeyCodec) and codec.group == KIVI_GROUP:
        return KVSource(KIVI_K, *tensors, residual=residual, bits=codec.bits, **base)
    if isinstance(codec, KiviValueCodec):
        return KVSource(KIVI_V, *tensors, residual=residual, bits=codec.bits, vgroup=codec.group, **base)
    return None


@triton.jit
def load_tile(data, scale, zero, res, blk, off, row, use_res, d, head, H, W, D, tmask, dmask,
              BS: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, VG: tl.constexpr):
    """Entries at (block `blk`, offset `off`) [N] (a tile may span several blocks), columns `d`
    [DB] of KV head `head`: [N, DB] float32, 0 where `tmask` [N] or `dmask` [DB] is False.
    KIVI entries whose `use_res` [N] is True read their block's residual `row` [N] instead."""
    vec = (blk.to(tl.int64) * BS + off) * H + head                                   # [N]
    mask = tmask[:, None] & dmask[None, :]
    if FMT == 0:
        x = tl.load(data + vec[:, None] * W + d[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FMT <= 3:
        raw = tl.load(data + vec[:, None] * W + d[None, :], mask=mask, other=0)
        if FMT == 1:
            x = raw.to(tl.float32)
        elif FMT == 2:
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            x = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
        x = x * tl.load(scale + vec, mask=tmask, other=0.0).to(tl.float32)[:, None]
    else:
        PER: tl.constexpr = 8 // BITS
        packed = tmask & ~use_res
        pmask = packed[:, None] & dmask[None, :]
        byte = tl.load(data + vec[:, None] * (W // PER) + (d // PER)[None, :], mask=pmask, other=0).to(tl.int32)
        code = ((byte >> ((d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        if FMT == 4:   # keys: per channel over groups of 32 tokens
            grp = (blk.to(tl.int64) * (BS // 32) + off // 32) * H + head
            meta = grp[:, None] * W + d[None, :]
        else:          # values: per token over groups of VG channels
            meta = vec[:, None] * (W // VG) + (d // VG)[None, :]
        sc = tl.load(scale + meta, mask=pmask, other=0.0).to(tl.float32)
        zp = tl.load(zero + meta, mask=pmask, other=0.0).to(tl.float32)
        rvec = (row.to(tl.int64) * BS + off) * H + head
        rmask = (tmask & use_res)[:, None] & dmask[None, :]
        exact = tl.load(res + rvec[:, None] * W + d[None, :], mask=rmask, other=0.0).to(tl.float32)
        x = tl.where(use_res[:, None], exact, code * sc + zp)
    return x


@triton.jit
def load_kv(kd, ks, kz, kr, vd, vs, vz, vr, row_of_block, sealed, blk, page, own_page, live, off, tmask,
            dk, dv, head, H, KW, KD, VW, VD, BS: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
            K_BITS: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, RESIDUAL: tl.constexpr):
    """K [N, BLOCK_DK] and V [N, BLOCK_DV] of a tile (float32) and each key's residual row. KIVI
    (RESIDUAL): a block reads its residual row while it has one and is not sealed, or when it is
    `own_page` (the query's own block)."""
    if RESIDUAL:
        row = tl.load(row_of_block + blk, mask=live, other=-1)
        use_res = (row >= 0) & ((tl.load(sealed + blk, mask=live, other=1) == 0) | (page == own_page))
    else:
        row = off
        use_res = off < 0
    k = load_tile(kd, ks, kz, kr, blk, off, row, use_res, dk, head, H, KW, KD, tmask, dk < KD,
                  BS, K_FMT, K_BITS, 1)
    v = load_tile(vd, vs, vz, vr, blk, off, row, use_res, dv, head, H, VW, VD, tmask, dv < VD,
                  BS, V_FMT, V_BITS, V_GROUP)
    return k, v, row


@triton.jit
def mma(a, b, DT: tl.constexpr):
    """a @ b accumulated in float32, the operands in float32 (DT 0), bfloat16 (1) or float16 (2);
    DT 3 rounds them to bfloat16 and multiplies in float32 (the same products: the interpreter has
    no bfloat16 dot)."""
    if DT == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DT == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif DT == 3:
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


def dot_dtype(dtype: torch.dtype) -> int:
    """The `mma` DT for a model dtype (see DOT_DTYPES)."""
    dt = DOT_DTYPES.get(dtype, 0)
    return 3 if dt == 1 and os.environ.get("TRITON_INTERPRET") == "1" else dt
