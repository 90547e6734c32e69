"""The C++ few-row GEMVs (kvserve/model/cpu/gemv.cpp) against torch's kernels and a float64 oracle."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import int16_row_error, int16_rows

from kvserve import native
from kvserve.model import cpu
from kvserve.model.quant import (
    GEMV_ROWS,
    TILE_ROWS,
    Int4GroupLinear,
    cpu_int4_rows,
    gguf_nibbles,
    int4_codes_t,
    make_linear,
)


def test_the_ops_build_here():
    """This machine has a compiler and torch's headers: the ops must build (no silent fallback)."""
    assert cpu.available()


def _ulps_bf16(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Largest |got - want| in units of a bfloat16 step at `scale` (per element; by default the
    larger of |got| and |want|, the step both roundings could take, floored at 2^-10 of the largest
    |want|: float32 sums of either order err that much where a row's products cancel)."""
    if scale is None:
        big = torch.maximum(got.double().abs(), want.double().abs())
        scale = big + 2**-10 * want.double().abs().max()
    step = torch.exp2(torch.floor(torch.log2(scale.double().abs().clamp(min=1e-30))) - 7)
    return ((got.double() - want.double()).abs() / step.double()).max().item()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(40, 48), (96, 576), (33, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_rounds_as_torchs_int8_kernel(rows, n, k, dtype):
    """x and scale in bfloat16, float32 sums, bfloat16 result: torch's _weight_int8pack_mm to within
    one bfloat16 step (sums in another order), for row groups of 1-4, K tails and N % 16 != 0."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    got = torch.ops.kvserve_cpu.int8_gemv(x, w, scale)
    want = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, scale)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert torch.equal(got.to(torch.bfloat16).float(), got.float())          # rounded to bfloat16
    exact = (x.to(torch.bfloat16).double() @ w.double().T) * scale.double()
    assert _ulps_bf16(got, exact, exact) <= 1.0
    assert _ulps_bf16(got, want) <= 1.0


def _q4g_operands(n: int, k: int, g: torch.Generator):
    """codes [N, K] 0..15, the GEMV's (tiles, tile scales) of them (q4g_tile from GGUF's nibbles),
    float16 scales and mins [N, K/32] (Q4_1-like: negative mins, some groups of Q4_0's form min = -8
    scale), the mins [K/32, N]."""
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    mins = (-8 * scales.float() * (torch.rand(n, k // 32, generator=g) * 0.5 + 0.75)).half()
    mins[::3] = -8 * scales[::3]
    return codes, torch.ops.kvserve_cpu.q4g_tile(gguf_nibbles(codes), scales), scales, mins, mins.t().contiguous()


def _q4g_float64(x, codes, scales, mins) -> torch.Tensor:
    """The q4g product in float64 on the GEMV's int16 rows: x^ (code * scale + min)^T."""
    n, k = codes.shape
    w = codes.double().view(n, k // 32, 32) * scales.double()[..., None] + mins.double()[..., None]
    return int16_rows(x).double() @ w.view(n, k).T


def _check_q4g(rows: int, n: int, k: int) -> None:
    """q4g_gemv against the float64 product of the int16-quantized rows: float32 results within 1e-5
    of the largest value, bfloat16 ones the float32 result rounded; and within the quantization's
    error of the float product of the weight (a row's error is at most 1/65534 of its group's largest)."""
    assert cpu.available()
    g = torch.Generator().manual_seed(rows * 100 + n + k)
    codes, tiled, scales, mins, mins_t = _q4g_operands(n, k, g)
    x = torch.randn(rows, k, generator=g)
    got = torch.ops.kvserve_cpu.q4g_gemv(x, *tiled, mins_t, n)
    want = _q4g_float64(x, codes, scales, mins)
    case = f"{rows}x{k} -> {n}"
    assert got.dtype == torch.float32 and got.shape == (rows, n), case
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), case
    got16 = torch.ops.kvserve_cpu.q4g_gemv(x.bfloat16(), *tiled, mins_t, n)   # float32 sums, rounded once
    assert torch.equal(got16, torch.ops.kvserve_cpu.q4g_gemv(x.bfloat16().float(), *tiled, mins_t, n).bfloat16())
    w = codes.double().view(n, k // 32, 32) * scales.double()[..., None] + mins.double()[..., None]
    exact = x.double() @ w.view(n, k).T
    bound = (x.double().view(rows, k // 32, 32).abs().amax(-1) / 65534).repeat_interleave(32, 1) @ w.view(n, k).abs().T
    assert ((got.double() - exact).abs() <= bound + 1e-5 * exact.abs().max()).all(), case


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 96), (192, 576), (96, 1536)])
def test_q4g_gemv_against_the_float64_product(rows, n, k):
    """Every tile of rows (4, 3, 2, 1) and channels (4, 2, 1: N % 4 != 0), one to 48 groups."""
    _check_q4g(rows, n, k)


def test_q4g_rows_do_not_depend_on_the_row_count():
    """Each row of a 1..130-row call is bit-identical to the same row alone (every tile computes a
    row alike): a step verifying speculated tokens decodes them as one-row steps would."""
    g = torch.Generator().manual_seed(5)
    _, tiled, _, _, mins = _q4g_operands(75, 576, g)
    x = torch.randn(130, 576, generator=g)
    for m in (mins, None):
        alone = torch.cat([torch.ops.kvserve_cpu.q4g_gemv(x[i:i + 1], *tiled, m, 75) for i in range(130)])
        for rows in (2, 3, 4, 5, 6, 7, 8, 9, 17, 64, 130):
            assert torch.equal(torch.ops.kvserve_cpu.q4g_gemv(x[:rows], *tiled, m, 75), alone[:rows]), rows


def test_q4g_layer_holds_gguf_blocks_exactly():
    """An int4 layer built from a GGUF's Q4_0 / Q4_1 groups keeps them exactly (codes, float16 scales
    and mins, the file's own); its dequantized weight (q4g_dequantize, code * scale + min in one fused step) is the
    decoder's own to within one float32 rounding."""
    from kvserve.model.gguf_blocks import Int4Groups
    g = torch.Generator().manual_seed(9)
    codes, _, scales, mins, mins_t = _q4g_operands(64, 256, g)
    groups = Int4Groups(codes, scales.float(), mins.float())
    layer = make_linear(groups, None, "int4")
    assert isinstance(layer, Int4GroupLinear)
    assert torch.equal(layer.codes(), codes)
    assert torch.equal(layer.group_scales(), scales)
    assert torch.equal(layer.mins, mins_t)
    want = groups.dequantize()
    bound = 2**-23 * (scales.float().abs().max() * 15 + mins.float().abs().max())
    assert ((layer.dequantize() - want).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("n,k", [(37, 96), (192, 576)])
def test_without_mins_the_4_and_5_bit_codes_are_centred(rows, n, k):
    """q4g / q5g with no mins take Q4_0's and Q5_0's centred codes, w = (code - 8) * scale and (code -
    16) * scale: against the float64 product of the GEMV's int16 rows, within 1e-5 of the largest
    value, every row as it is alone; the dequantized weights are the float64 ones to a float32 rounding."""
    assert cpu.available()
    ops = torch.ops.kvserve_cpu
    g = torch.Generator().manual_seed(rows * 10 + k)
    x = torch.randn(rows, k, generator=g)
    codes4, tiled, scales4, _, _ = _q4g_operands(n, k, g)
    codes5 = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    scales5 = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    for name, (gemv, dequantize), codes, stored, scales, offset in [
            ("q4g", (lambda x, *w: ops.q4g_gemv(x, *w, n), lambda *w: ops.q4g_dequantize(*w, n, torch.float32)), codes4,
             tiled, scales4, 8),
            ("q5g", (lambda x, *w: ops.q5g_gemv(x, *w, n), lambda *w: ops.q5g_dequantize(*w, n, torch.float32)), codes5,
             ops.q5g_tile(codes5, scales5), scales5, 16)]:
        w = ((codes.double() - offset).view(n, k // 32, 32) * scales.double()[..., None]).view(n, k)
        got = gemv(x, *stored, None)
        want = int16_rows(x).double() @ w.T
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), name
        alone = torch.cat([gemv(x[i:i + 1], *stored, None) for i in range(rows)])
        assert torch.equal(got, alone), name
        terms = ((codes.double() + offset).view(n, k // 32, 32) * scales.double()[..., None]).view(n, k)
        assert ((dequantize(*stored, None).double() - w).abs() <= 2**-23 * terms).all(), name   # fused or not


def _q5g_operands(n: int, k: int, g: torch.Generator, half: bool):
    """codes [N, K] 0..31, the GEMV's (tiles, tile scales) of them (q5g_tile), scales and mins [N, K/32]
    (float16 as Q5_0 / Q5_1 store them, or float32 as Q5_K's products; some groups of Q5_0's form min
    = -16 scale)."""
    codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    mins = -16 * scales * (torch.rand(n, k // 32, generator=g) * 0.5 + 0.75)
    mins[::3] = -16 * scales[::3]
    if half:
        scales, mins = scales.half(), mins.half()
    return codes, torch.ops.kvserve_cpu.q5g_tile(codes, scales), scales, mins


def _check_q5g(rows: int, n: int, k: int) -> None:
    """q5g_gemv (float16 and float32 scales) against the float64 product of its int16 rows, within 1e-5
    of the largest value; bfloat16 x gives the float32 result rounded once; q5g_dequantize gives
    code * scale + min within one float32 rounding."""
    assert cpu.available()
    ops = torch.ops.kvserve_cpu
    for half in (True, False):
        g = torch.Generator().manual_seed(rows * 100 + n + k + half)
        codes, tiled, scales, mins = _q5g_operands(n, k, g, half)
        mins_t = mins.t().contiguous()
        w = codes.double().view(n, k // 32, 32) * scales.double()[..., None] + mins.double()[..., None]
        w = w.view(n, k)
        x = torch.randn(rows, k, generator=g)
        got = ops.q5g_gemv(x, *tiled, mins_t, n)
        want = int16_rows(x).double() @ w.T
        case = f"{rows}x{k} -> {n}, {scales.dtype}"
        assert got.dtype == torch.float32 and got.shape == (rows, n), case
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), case
        got16 = ops.q5g_gemv(x.bfloat16(), *tiled, mins_t, n)
        assert torch.equal(got16, ops.q5g_gemv(x.bfloat16().float(), *tiled, mins_t, n).bfloat16()), case
        wide = ops.q5g_dequantize(*tiled, mins_t, n, torch.float32)   # a product and a sum, fused or not
        terms = codes.double().view(n, k // 32, 32) * scales.double()[..., None] - mins.double()[..., None]
        assert ((wide.double() - w).abs() <= 2**-23 * terms.abs().view(n, k)).all(), case


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 96), (192, 576), (96, 1536)])
def test_q5g_gemv_against_the_float64_product(rows, n, k):
    """Every tile of rows, whole and padded tiles of channels, one to 48 groups (the fifth bits of both
    nibbles' lanes), float16 and float32 scales."""
    _check_q5g(rows, n, k)


def test_q5g_rows_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(6)
    _, tiled, scales, mins = _q5g_operands(75, 576, g, True)
    x = torch.randn(130, 576, generator=g)
    for m in (mins.t().contiguous(), None):
        alone = torch.cat([torch.ops.kvserve_cpu.q5g_gemv(x[i:i + 1], *tiled, m, 75) for i in range(130)])
        for rows in (2, 3, 5, 8, 17, 130):
            assert torch.equal(torch.ops.kvserve_cpu.q5g_gemv(x[:rows], *tiled, m, 75), alone[:rows]), rows


def test_the_tiles_keep_every_code_and_refuse_wider_ones():
    """Every code of every channel and input comes back from the tiles as it went in (dequantized with
    scale 1 and min 0), 4-bit and 5-bit (a tile's every lane and fifth bit), the last tile padded;
    codes past 5 bits and tiles of another layout are refused."""
    ops = torch.ops.kvserve_cpu
    g = torch.Generator().manual_seed(3)
    n, k = 37, 64
    ones, zeros = torch.ones(n, k // 32), torch.zeros(k // 32, n)
    codes5 = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    assert torch.equal(ops.q5g_dequantize(*ops.q5g_tile(codes5, ones), zeros, n, torch.float32), codes5.float())
    assert torch.equal(ops.q5g_dequantize(*ops.q5g_tile(codes5, ones.half()), zeros.half(), n, torch.float32), codes5.float())
    codes4 = codes5 % 16
    tiled4 = ops.q4g_tile(gguf_nibbles(codes4), ones.half())
    assert torch.equal(ops.q4g_dequantize(*tiled4, zeros.half(), n, torch.float32), codes4.float())
    with pytest.raises(RuntimeError, match="codes must lie in 0..31, got 32"):
        ops.q5g_tile(torch.full((16, 32), 32, dtype=torch.uint8), torch.ones(16, 1))
    with pytest.raises(RuntimeError, match=r"uint8 tiles \[N/16, K/32, 320\] expected"):
        ops.q5g_gemv(torch.randn(1, 64), *tiled4, None, n)


def _invariant_operands(kind: str, n: int, k: int, g: torch.Generator):
    """(call x -> y, as float32) for one GEMV op with invariant=True, its weight drawn from g."""
    assert cpu.available()
    ops = torch.ops.kvserve_cpu
    if kind == "int8":
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, generator=g) * 0.02).to(torch.bfloat16)
        return lambda x: ops.int8_gemv(x, w, scale, True)
    if kind in ("bfloat16", "float16"):
        dtype = getattr(torch, kind)
        w = torch.randn(n, k, generator=g).to(dtype)
        op = ops.bf16_gemv if kind == "bfloat16" else ops.f16_gemv
        return lambda x: op(x.to(dtype), w, True).float()
    group, mins = (16, True) if kind == "q8g-16-mins" else (32, False)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.01
    mn = -torch.rand(k // group, n, generator=g) * 0.1 if mins else None
    return lambda x: _q8g_gemv(x, codes, scales, mn, group)   # rows independent: no invariant flag


@pytest.mark.parametrize("kind", ["int8", "bfloat16", "float16", "q8g-32", "q8g-16-mins"])
def test_invariant_gemvs_give_a_row_the_same_bits_at_every_row_count(kind):
    """invariant=True (the batch-invariant mode): each row of a 1..64-row call is bit-identical to
    the same row alone; without it a lone row takes the one-row kernel's other summation order."""
    g = torch.Generator().manual_seed(7)
    n, k = 96, 1536
    call = _invariant_operands(kind, n, k, g)
    x = torch.randn(64, k, generator=g)
    alone = torch.cat([call(x[i:i + 1]) for i in range(64)])
    for rows in (2, 3, 4, 5, 8, 9, 16, 17, 33, 64):
        assert torch.equal(call(x[:rows]), alone[:rows]), rows


def _integer_calls(n: int, k: int, g: torch.Generator) -> dict:
    """x -> y for each integer GEMV (q4g, q5g, q8g with groups of 32 and of 16 with mins) on weights
    drawn from g."""
    assert cpu.available()
    ops = torch.ops.kvserve_cpu
    _, tiled, s4, _, m4 = _q4g_operands(n, k, g)
    _, tiled5, s5, m5 = _q5g_operands(n, k, g, True)
    m5 = m5.t().contiguous()
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s32, s16 = torch.rand(n, k // 32, generator=g) * 0.01, torch.rand(n, k // 16, generator=g) * 0.01
    m16 = -torch.rand(k // 16, n, generator=g) * 0.1
    return {"q4g": lambda x: ops.q4g_gemv(x, *tiled, m4, n),
            "q5g": lambda x: ops.q5g_gemv(x, *tiled5, m5, n),
            "q8g-32": lambda x: _q8g_gemv(x, codes, s32, None, 32),
            "q8g-16-mins": lambda x: _q8g_gemv(x, codes, s16, m16, 16)}


@pytest.mark.parametrize("rows", [1, 5])
def test_integer_gemvs_give_the_same_bits_on_more_threads(rows):
    """The suite runs one thread a process; an engine runs torch's threads, which split the output
    channels (each thread with its own prefetch bounds, all reading the calling thread's quantized
    rows): two and three threads give the one-thread result bit for bit, on weights far larger
    than one thread's prefetch distance and on small ones."""
    g = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    for n, k in [(4000, 576), (48, 96)]:
        calls = _integer_calls(n, k, g)
        x = torch.randn(rows, k, generator=g)
        try:
            torch.set_num_threads(1)
            alone = {name: call(x) for name, call in calls.items()}
            for threads in (2, 3):
                torch.set_num_threads(threads)
                for name, call in calls.items():
                    assert torch.equal(call(x), alone[name]), (name, n, k, threads)
        finally:
            torch.set_num_threads(before)


def _pack_by_hand(codes: torch.Tensor, block: int) -> torch.Tensor:
    """codes [N, K] in torch's CPU int4 layout for blocks of `block` rows: per block, per input channel,
    block/2 bytes, row c's code in byte c's low nibble and row block/2 + c's in its high nibble."""
    n, k = codes.shape
    v = codes.view(n // block, 2, block // 2, k).permute(0, 3, 1, 2)      # [N/B, K, 2, B/2]
    return (v[:, :, 0] | (v[:, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2)


def test_torchs_int4_layout_is_the_one_unpacked_here():
    """cpu_int4_rows() names the block torch packs with on this CPU (64 under AVX512, 32 under AVX2):
    the hand-packed layout is torch's byte for byte, and unpacks to the codes."""
    codes = torch.randint(0, 16, (192, 64), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert cpu_int4_rows() == (64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32)
    assert torch.equal(packed, _pack_by_hand(codes, cpu_int4_rows()))
    assert torch.equal(int4_codes_t(packed).t().int(), codes)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("n,k", [(16, 32), (50, 96), (96, 576), (40, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gemvs_against_the_float64_product(rows, n, k, dtype):
    """bfloat16 / float16 x and w, float32 sums, one rounding to the 16-bit type: within one step
    of that type of the exact product of the stored values (float32 sums over k err far less)."""
    g = torch.Generator().manual_seed(rows * 100 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    op = torch.ops.kvserve_cpu.bf16_gemv if dtype == torch.bfloat16 else torch.ops.kvserve_cpu.f16_gemv
    got = op(x, w)
    exact = x.double() @ w.double().T
    assert got.dtype == dtype and got.shape == (rows, n)
    mantissa = 7 if dtype == torch.bfloat16 else 10
    step = torch.exp2(torch.floor(torch.log2(exact.abs() + 1e-3 * exact.abs().max())) - mantissa)
    assert ((got.double() - exact).abs() / step).max() <= 1.0


def _q8g_gemv(x, codes, scales, mins_t, group):
    """q8g_gemv on codes [N, K] and scales [N, K/group], tiled by q8g_tile for the call."""
    ops = torch.ops.kvserve_cpu
    return ops.q8g_gemv(x, *ops.q8g_tile(codes, scales, group), mins_t, group, codes.shape[0])


def _q8g_operands(rows: int, n: int, k: int, group: int, mins: bool, dtype: torch.dtype, seed: int):
    """x, codes, scales, mins as the GGUF decoders give them: signed int8 codes (Q8_0's range) without
    mins, unsigned 5-bit codes (Q5_1 / Q5_K) with them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    codes = (torch.randint(0, 32, (n, k), generator=g) if mins else torch.randint(-128, 128, (n, k), generator=g))
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    m = -16 * scales * (torch.rand(n, k // group, generator=g) + 0.5) if mins else None
    return x, codes.to(torch.int8), scales, m


def _q8g_float64(x, codes, scales, mins, group) -> torch.Tensor:
    """The q8g product in float64: per group, scale * sum(x code) + min * sum(x)."""
    n, k = codes.shape
    xg = x.double().view(x.shape[0], 1, k // group, group)
    dots = (xg * codes.double().view(1, n, k // group, group)).sum(-1)
    y = (dots * scales.double()).sum(-1)
    if mins is not None:
        y += (xg.sum(-1) * mins.double()).sum(-1)
    return y


def _check_q8g(rows: int, group: int) -> None:
    """q8g_gemv against float64 math on its int16 rows (mins [K/group, N]), for both dtypes of x, with
    and without mins, three widths (N % 4 != 0; 3, 5 and 20 blocks: the tile's scales converted
    eight groups at a time, then a tail, at 5 blocks of groups of 16): float32 results within 1e-5 of the
    result's largest value and within the int16 rows' bound of the product of x itself, bfloat16 ones
    the float32 result rounded once."""
    assert cpu.available()
    for n, k in [(40, 96), (24, 160), (33, 640)]:
        for dtype in (torch.float32, torch.bfloat16):
            for mins in (False, True):
                x, codes, scales, m = _q8g_operands(rows, n, k, group, mins, dtype, rows * 100 + n + group)
                m_t = None if m is None else m.t().contiguous()
                got = _q8g_gemv(x, codes, scales, m_t, group)
                case = f"{rows}x{k} -> {n}, group {group}, {dtype}, mins {mins}"
                assert got.dtype == dtype and got.shape == (rows, n), case
                if dtype == torch.bfloat16:
                    wide = _q8g_gemv(x.float(), codes, scales, m_t, group)
                    assert torch.equal(got, wide.bfloat16()), case
                    continue
                want = _q8g_float64(int16_rows(x), codes, scales, m, group)
                assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), case
                exact = _q8g_float64(x, codes, scales, m, group)
                w = codes.double().view(n, -1, group) * scales.double()[..., None]
                if m is not None:
                    w = w + m.double()[..., None]
                bound = int16_row_error(x, w.view(n, k)) + 1e-5 * exact.abs().max()
                assert ((got.double() - exact).abs() <= bound).all(), case


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 64])
@pytest.mark.parametrize("group", [16, 32])
def test_q8g_gemv_against_float64(rows, group):
    """Every row count the row groups split differently (one-row pass, partial tiles, the 64 limit)."""
    _check_q8g(rows, group)


def test_q8g_gemv_in_a_compiled_graph_gives_eager_results():
    """torch.compile(fullgraph=True) traces the op through its Meta kernel and calls it: same values."""
    assert cpu.available()
    x, codes, scales, mins = _q8g_operands(3, 48, 128, 32, True, torch.float32, 7)
    mins = mins.t().contiguous()
    ops = torch.ops.kvserve_cpu
    tiled32, tiled16 = ops.q8g_tile(codes, scales, 32), ops.q8g_tile(codes, torch.rand(48, 128 // 16), 16)

    def f(x):
        return ops.q8g_gemv(x, *tiled32, mins, 32, 48) + ops.q8g_gemv(x, *tiled16, None, 16, 48)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x), f(x))


def test_widening_to_bfloat16_rounds_the_float32_weight():
    """q4g / q5g / q8g dequantized to bfloat16 are their float32 weights rounded to nearest even (torch's
    own rounding) at every channel and input: a padded last tile, groups of 16 and 32, with and without
    mins, float16 and float32 scales; another dtype is refused with what to ask for."""
    assert cpu.available()
    ops = torch.ops.kvserve_cpu
    g = torch.Generator().manual_seed(12)
    n, k = 37, 96
    _, tiled4, _, _, mins4 = _q4g_operands(n, k, g)
    _, tiled5, _, mins5 = _q5g_operands(n, k, g, False)
    codes8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales8 = torch.rand(n, k // 16, generator=g) * 0.02 + 1e-3
    tiled8 = ops.q8g_tile(codes8, scales8.half(), 16)
    mins8 = (-scales8[:, ::2] * 3).t().contiguous()
    widen = {"q4g": lambda m, d: ops.q4g_dequantize(*tiled4, m, n, d),
             "q5g": lambda m, d: ops.q5g_dequantize(*tiled5, m, n, d),
             "q8g-16": lambda m, d: ops.q8g_dequantize(*tiled8, m if m is None else m.half(), 16, n, d),
             "q8g-32": lambda m, d: ops.q8g_dequantize(*ops.q8g_tile(codes8, scales8[:, ::2].contiguous(), 32),
                                                       m, 32, n, d)}
    mins = {"q4g": mins4, "q5g": mins5.t().contiguous(), "q8g-16": torch.cat([mins8, mins8]), "q8g-32": mins8}
    for name, f in widen.items():
        for m in (mins[name], None):
            wide = f(m, torch.float32)
            assert wide.dtype == torch.float32 and wide.shape == (n, k)
            assert torch.equal(f(m, torch.bfloat16), wide.to(torch.bfloat16)), name
        with pytest.raises(RuntimeError, match="float32 or bfloat16 out, not Half"):
            f(None, torch.float16)


NARROW_CHECKS = """
import torch
from kvserve import native
from kvserve.attention import cpu as attention
from kvserve.model import cpu
import test_cpu_gemv as t, test_paged_attention as pa
assert cpu.available() and attention.kernel()
for group in (16, 32):
    for rows in (1, 2, 5, 16):
        t._check_q8g(rows, group)
for kind in ("int8", "bfloat16", "float16", "q8g-32", "q8g-16-mins"):
    t.test_invariant_gemvs_give_a_row_the_same_bits_at_every_row_count(kind)
for rows in (1, 3, 5):
    t.test_int8_gemv_rounds_as_torchs_int8_kernel(rows, 33, 1536, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        t.test_16_bit_gemvs_against_the_float64_product(rows, 50, 96, dtype)
    t._check_q4g(rows, 37, 576)
    t._check_q5g(rows, 37, 576)
t.test_q4g_rows_do_not_depend_on_the_row_count()
t.test_q5g_rows_do_not_depend_on_the_row_count()
t.test_the_tiles_keep_every_code_and_refuse_wider_ones()
t.test_widening_to_bfloat16_rounds_the_float32_weight()
pa.test_cpu_kernel_equals_attention_formula(64, 3, 9)
pa.test_cpu_kernel_float32_queries_over_bfloat16_pools(4, 64)
print(cpu.library())
print(native.build(attention.SOURCE, *native.torch_op_flags()))
"""


@pytest.mark.parametrize("flags,registers", [("-mno-avx512f", "ymm"), ("-mno-avx", "xmm")],
                         ids=["avx2", "portable"])
def test_the_narrower_vector_paths_give_the_same_results(tmp_path, flags, registers):
    """Built without AVX-512 (-mno-avx512f: the AVX2 path, 8-float vectors, on a CPU that has AVX2)
    or without AVX (-mno-avx: the portable path, GCC's vector extensions on 4-float SSE vectors), in
    a fresh process: the GEMVs and the decode attention kernel (simd.h's helpers) pass the float64
    and row-invariance checks, and neither library uses a wider register."""
    tests = Path(__file__).parent
    env = {**os.environ, "KVSERVE_CPU_KERNEL_FLAGS": flags,
           "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", NARROW_CHECKS], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    libraries = done.stdout.strip().splitlines()[-2:]
    assert libraries[0] != str(cpu.library())
    wider = {"ymm": ["zmm"], "xmm": ["ymm", "zmm"]}[registers]
    for library in libraries:
        asm = subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=True).stdout
        assert registers in asm and not any(w in asm for w in wider), library


def test_zero_rows_give_an_empty_result():
    w = torch.zeros(32, 64, dtype=torch.int8)
    assert torch.ops.kvserve_cpu.int8_gemv(torch.randn(0, 64), w, torch.ones(32, dtype=torch.bfloat16)).shape == (0, 32)
    assert torch.ops.kvserve_cpu.bf16_gemv(torch.randn(0, 64).bfloat16(), w.bfloat16()).shape == (0, 32)
    for x in (torch.randn(0, 64), torch.randn(0, 64).bfloat16()):
        y = _q8g_gemv(x, w, torch.ones(32, 2), torch.ones(2, 32), 32)
        assert y.shape == (0, 32) and y.dtype == x.dtype
        tiled = torch.ops.kvserve_cpu.q4g_tile(w.view(torch.uint8)[:, :32].contiguous(), torch.ones(32, 2).half())
        y = torch.ops.kvserve_cpu.q4g_gemv(x, *tiled, torch.ones(2, 32).half(), 32)
        assert y.shape == (0, 32) and y.dtype == x.dtype


def _q4g(x=None, tiles=None, scales=None, mins=None, n=32):
    """q4g_gemv on valid operands (K = 64, 32 channels) but for the one given."""
    good_tiles, good_scales = torch.ops.kvserve_cpu.q4g_tile(torch.zeros(32, 32, dtype=torch.uint8), torch.ones(32, 2).half())
    return torch.ops.kvserve_cpu.q4g_gemv(torch.randn(1, 64) if x is None else x, good_tiles if tiles is None else tiles,
                                          good_scales if scales is None else scales, mins, n)


def _q8g(x=None, codes=None, scales=None, mins=None, group=32, k=64, n=32):
    """q8g_gemv on valid operands of width k (32 channels) but for the one given (codes and scales
    through q8g_tile)."""
    x = torch.randn(1, k) if x is None else x
    codes = torch.zeros(32, k, dtype=torch.int8) if codes is None else codes
    scales = torch.ones(32, k // 32) if scales is None else scales
    ops = torch.ops.kvserve_cpu
    return ops.q8g_gemv(x, *ops.q8g_tile(codes, scales, 32 if group not in (16, 32) else group), mins, group, n)


@pytest.mark.parametrize("call,message", [
    (lambda: torch.ops.kvserve_cpu.int8_gemv(torch.randn(1, 40), torch.zeros(32, 40, dtype=torch.int8),
                                             torch.ones(32, dtype=torch.bfloat16)), "multiple of 16"),
    (lambda: torch.ops.kvserve_cpu.int8_gemv(torch.randn(1, 32), torch.zeros(32, 32, dtype=torch.int8),
                                             torch.ones(32)), "bfloat16 scale"),
    (lambda: torch.ops.kvserve_cpu.int8_gemv(torch.randn(1, 32), torch.zeros(8, 32, dtype=torch.int8),
                                             torch.ones(8, dtype=torch.bfloat16)), "16 output channels"),
    (lambda: torch.ops.kvserve_cpu.bf16_gemv(torch.randn(1, 32), torch.zeros(32, 32, dtype=torch.bfloat16)),
     "bfloat16 x and w"),
    (lambda: torch.ops.kvserve_cpu.bf16_gemv(torch.randn(65, 32).bfloat16(), torch.zeros(32, 32).bfloat16()),
     "at most 64 rows"),
    (lambda: torch.ops.kvserve_cpu.bf16_gemv(torch.randn(2, 64).bfloat16()[:, ::2], torch.zeros(32, 32).bfloat16()),
     "contiguous"),
    (lambda: _q8g(group=64), "group must be 16 or 32, got 64"),
    (lambda: _q8g(k=48), "K must be a multiple of 32"),
    (lambda: _q8g(codes=torch.zeros(32, 64)), r"int8 codes \[N, K\] expected, got Float"),
    (lambda: _q8g(n=33), "2 tiles hold 17..32 channels, not 33"),
    (lambda: _q8g(x=torch.randn(1, 96)), r"contiguous x \[M, 64\] expected"),
    (lambda: _q8g(x=torch.randn(1, 64).half()), "float32 or bfloat16 x expected, got Half"),
    (lambda: _q8g(scales=torch.ones(2, 32)), r"Float scales \[N, K/group\] = \[32, 2\] expected, got Float \[2, 32\]"),
    (lambda: _q8g(mins=torch.ones(2, 32).bfloat16()), r"Float mins \[K/group, N\] = \[2, 32\] expected, got BFloat16"),
    (lambda: _q8g(mins=torch.ones(32, 2)), r"Float mins \[K/group, N\] = \[2, 32\] expected, got Float \[32, 2\]"),
    (lambda: _q8g(scales=torch.ones(32, 2).half(), mins=torch.ones(2, 32)), r"Half mins \[K/group, N\] = \[2, 32\] expected, got Float"),
    (lambda: torch.ops.kvserve_cpu.q4g_tile(torch.zeros(32, 24, dtype=torch.uint8), torch.ones(32, 1).half()),
     "K must be a multiple of 32"),
    (lambda: _q4g(tiles=torch.zeros(32, 32, dtype=torch.uint8)), r"uint8 tiles \[N/16, K/32, 256\] expected"),
    (lambda: _q4g(n=40), "2 tiles hold 17..32 channels, not 40"),
    (lambda: _q4g(x=torch.randn(1, 64).half()), "float32 or bfloat16 x"),
    (lambda: _q4g(x=torch.randn(1, 96)), r"contiguous x \[M, 64\] expected"),
    (lambda: _q4g(scales=torch.ones(2, 2, 16)), r"float16 scales \[N/16, K/32, 16\] expected, got Float"),
    (lambda: _q4g(mins=torch.ones(2, 32)), r"Half mins \[K/group, N\] = \[2, 32\] expected, got Float"),
])
def test_bad_shapes_get_a_clear_error(call, message):
    """The ops check their inputs (the layers only call them with shapes they take)."""
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16", "float16"])
def test_layers_use_the_gemv_for_few_rows_and_match_torchs_path(fmt):
    """A CPU int8 / int4 / bfloat16 / float16 layer serves few-row steps with the op; with it
    switched off (torch's kernels) the same rows give the same values to within one bfloat16 step."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(128, 96, generator=g), torch.randn(128, generator=g)
    q = make_linear(w, b, fmt)
    assert q.gemv
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    for rows in sorted({1, 2, {"int8": 16, "int4": TILE_ROWS}.get(fmt) or GEMV_ROWS[fmt]}):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        with torch.profiler.profile() as prof:
            fast = q(x)
        name = {"int8": "int8", "int4": "q4g", "bfloat16": "bf16", "float16": "f16"}[fmt]
        assert any(e.key == f"kvserve_cpu::{name}_gemv" for e in prof.key_averages())
        q.use_gemv(False)
        ref = q(x)
        q.use_gemv(True)
        if fmt == "int4":   # int16-quantized rows against the float32 product of the same weight;
            # torch's path multiplies in bfloat16 where the CPU has bfloat16 units
            exact = x @ q.dequantize().T
            assert ((fast - b - exact).abs() <= 1e-4 * exact.abs().max()).all()
            assert ((ref - b - exact).abs() <= 2 ** -7 * exact.abs().max()).all()
        else:
            assert _ulps_bf16(fast - b.to(dtype), ref - b.to(dtype), ref - b.to(dtype)) <= 1.0


def test_without_a_compiler_layers_keep_torchs_kernels(monkeypatch, tmp_path, caplog):
    """The ops cannot be built: a warning says why, the layers run on torch's kernels."""
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(cpu.native.CACHE_ENV, str(tmp_path / "kernels"))
    with caplog.at_level("WARNING", logger="kvserve"):
        q = make_linear(torch.randn(32, 64), None, "int8")
    assert "CPU GEMV kernels unavailable (C++ compiler" in caplog.text
    assert not q.gemv
    x = torch.randn(2, 64)
    want = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q.qweight, q.scale_bf16).float()
    assert torch.equal(q(x), want)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "A KV cache stores", "Once upon a time"]


def _scores(llm, ids: list[list[int]]) -> torch.Tensor:
    """Log-prob of each next token of `ids` under `llm` (teacher-forced), flattened."""
    from kvserve import SamplingParams
    res = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)
    return torch.tensor([d[t].logprob for r, i in zip(res, ids) for d, t in zip(r.prompt_logprobs[1:], i[1:])])


@pytest.mark.parametrize("options,bound", [({"weights": "int8", "dtype": "float32"}, 0.1),
                                           ({"weights": "int4", "dtype": "float32"}, 0.15),
                                           ({"dtype": "bfloat16"}, 0.06)])
def test_an_engine_on_the_gemv_is_as_close_to_float32_as_on_torchs_kernels(llm, options, bound):
    """int8-weight, int4-weight and bfloat16 engines score the float32 engine's greedy continuations
    in steps of 4 tokens (so every linear runs on the GEMV): as close to float32's log-probs with the C++ GEMV
    (the default on a CPU) as with torch's kernels, and close in absolute terms."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.quant import quant_layers
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ids = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    want = _scores(llm, ids)
    eng = LLM(kv_cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=4, max_num_seqs=1,
              bf16_weight_copy="off", **options)
    layers = quant_layers(eng.engine.runner.model)
    assert layers and all(q.gemv for q in layers)
    fast = (_scores(eng, ids) - want).abs().mean().item()
    for q in layers:
        q.use_gemv(False)
    slow = (_scores(eng, ids) - want).abs().mean().item()
    assert 0 < fast < bound and fast < 1.25 * slow + 0.005, (fast, slow)


def test_build_kernels_covers_every_source_and_the_engine_looks_there_first(tmp_path, monkeypatch, capsys):
    """`kvserve build-kernels` writes every .cpp of the package into the installed folder, which a start
    reads before the first-use cache: with the libraries there (copied from this run's builds), the
    command and the engine's lookup find them without running the compiler, and the command removes
    the libraries of older sources."""
    from kvserve import cli

    package = Path(native.__file__).parent
    sources = [importlib.import_module(m).SOURCE for m in native.KERNEL_MODULES]
    assert set(sources) == set(package.rglob("*.cpp")) and sources[0] == cpu.SOURCE
    built = [native.build(source, *native.torch_op_flags()) for source in sources]
    installed = tmp_path / "installed"
    installed.mkdir()
    for library in built:
        shutil.copy(library, installed / library.name)
    (installed / "gemv-0123456789abcdef.so").write_bytes(b"a library of an older gemv.cpp")
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.setattr(native, "INSTALLED", installed)
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "empty-cache")

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled although the library is installed")

    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    assert native.search_dirs()[0] == installed
    assert cpu.library() == installed / built[0].name
    assert cli.main(["build-kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[:len(built)] == [str(installed / b.name) for b in built]
    assert sorted(p.name for p in installed.iterdir()) == sorted(b.name for b in built)   # the older one removed
