"""The K/V write as a kernel: new entries [T, H, D] (or MLA latents [T, D]) into the pool at their
slots, quantized on the way for int8 and fp8 (one float16 scale per (token, head) from the data,
as kvserve/kv/formats.py does; the same codes as its torch encoder).

One program per few tokens (about 16 (token, head) vectors). Rounding is written out (half to even, as torch.round and
torch's float8 casts do) so the compiled kernel and the interpreter agree with the codecs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.source import FP8_E4M3, FP8_E5M2, INT8, NATIVE, KVSource

STORABLE = (NATIVE, INT8, FP8_E4M3, FP8_E5M2)
FP16_TINY = 6.103515625e-05   # smallest normal float16: the scales' floor (formats.SCALE_FLOOR)
FP16_MAX = 65504.0


@triton.jit
def _rint(y):
    """Round half to even (y's integer part exact in float32)."""
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return r + tl.where((f > 0.5) | ((f == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _fp8_bits(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """float32 y (|y| within the float8 range) -> its float8 byte, rounded half to even."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    e = tl.maximum(e, 1 - BIAS)                                   # subnormals share the least exponent
    step = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - MBITS)
    n = _rint(a / step)
    carry = n >= (2 << MBITS)
    e = tl.where(carry, e + 1, e)
    n = tl.where(carry, n * 0.5, n).to(tl.int32)
    code = tl.where(n < (1 << MBITS), n, ((e + BIAS) << MBITS) + n - (1 << MBITS))
    return (code | ((bits >> 24) & 128)).to(tl.uint8)


@triton.jit
def _store_kernel(x, slots, data, scale, T, x_stride_t, x_stride_h, H, D,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr):
    r = tl.arange(0, BLOCK_T * BLOCK_H)           # rows: (token, head) vectors
    t = tl.program_id(0) * BLOCK_T + r // BLOCK_H
    h = r % BLOCK_H
    ok = (t < T) & (h < H)
    slot = tl.load(slots + t, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d < D)[None, :]
    src = x + (t.to(tl.int64) * x_stride_t + h * x_stride_h)[:, None] + d[None, :]
    dst = (slot * H + h)[:, None] * D + d[None, :]
    if FMT == 0:
        tl.store(data + dst, tl.load(src, mask=mask), mask=mask)
    else:
        v = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), 1)
        if FMT == 1:
            qmax = 127.0
        elif FMT == 2:
            qmax = 448.0
        else:
            qmax = 57344.0
        sc = tl.minimum(tl.maximum(amax / qmax, FP16_TINY), FP16_MAX).to(tl.float16)
        tl.store(scale + slot * H + h, sc, mask=ok)
        y = tl.minimum(tl.maximum(v / sc.to(tl.float32)[:, None], -qmax), qmax)
        if FMT == 1:
            tl.store(data + dst, _rint(y).to(tl.int8), mask=mask)
        elif FMT == 2:
            tl.store(data + dst, _fp8_bits(y, 3, 7), mask=mask)
        else:
            tl.store(data + dst, _fp8_bits(y, 2, 15), mask=mask)


def store(x: torch.Tensor, slots: torch.Tensor, dst: KVSource) -> None:
    """Write entries x [T, H, D] (or [T, D]) at flat slots [T] of `dst` (native, int8 or fp8)."""
    if dst.fmt not in STORABLE:
        raise ValueError(f"no store kernel for format {dst.fmt}")
    if x.shape[0] == 0:
        return
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    t, h, d = x3.shape
    sc = dst.scale if dst.scale is not None else dst.data
    block_h = triton.next_power_of_2(h)
    block_t = max(1, 16 // block_h)             # about 16 vectors per program
    _store_kernel[(triton.cdiv(t, block_t),)](x3, slots.contiguous(), dst.data, sc, t, x3.stride(0), x3.stride(1),
                                              h, d, BLOCK_T=block_t, BLOCK_H=block_h,
                                              BLOCK_D=triton.next_power_of_2(d), FMT=dst.fmt)
