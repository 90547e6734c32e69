"""Which kernel each weight-format class runs at each row count: an oracle written from the table in
docs/WEIGHTS.md ("Which kernel runs"), and each class's output against its dequantized weight."""


import pytest
import torch

from kvserve.model import quant
from kvserve.model.gguf_blocks import Int8Groups
from kvserve.model.quant import make_linear

ROWS = range(1, 200)


def ranges(*spans):
    """The kernel name per row count in ROWS from (last row, name) spans, the last span for any rows."""
    out = []
    for rows in ROWS:
        out.append(next(name for last, name in spans if last is None or rows <= last))
    return out


def picked(layer):
    return [layer.kernel_for(rows).__name__ for rows in ROWS]


def float_layer(fmt, n=96, k=128, tied=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    return make_linear(w, b, fmt, tied=w if tied else None)


def groups(kind="q8_0", n=48, k=256):
    g = torch.Generator().manual_seed(1)
    group = 16 if kind == "q6_k" else 32
    codes = torch.randint(-100, 100, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    mins = -torch.rand(n, k // group, generator=g) * 0.1 if kind == "q5_1" else None
    return Int8Groups(codes, scales, mins, group)


@pytest.fixture(params=[True, False], ids=["16-bit units", "no 16-bit units"])
def units(request, monkeypatch):
    monkeypatch.setattr(quant, "_native_half_cpu", lambda: request.param)
    return request.param


def test_the_cpu_gemvs_are_built():
    assert quant.cpu_gemv(torch.device("cpu"), "int8") and quant.q8g_kernel(torch.device("cpu"))


def test_float32_runs_f_linear_at_every_row_count(units):
    assert picked(float_layer("float32")) == ranges((None, "linear"))


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_16_bit_weights(fmt, units):
    """1-8 rows: the C++ GEMV; more: F.linear, or past 16 rows (past 1 with a tied float32
    embedding) float32 arithmetic on a CPU without 16-bit units."""
    wide = "linear" if units else "widened"
    assert picked(float_layer(fmt)) == ranges((8, "half_gemv"), (16, "linear"), (None, wide))
    assert picked(float_layer(fmt, tied=True)) == ranges((8, "half_gemv"), (None, wide))
    off = float_layer(fmt, tied=True)
    off.use_gemv(False)
    assert picked(off) == ranges((1, "linear"), (None, wide))
    narrow = float_layer(fmt, k=48)          # in_features not a multiple of 32: no GEMV
    assert picked(narrow) == ranges((16, "linear"), (None, wide))


def test_a_float16_head_with_a_row_kernel_runs_it_for_one_row(units):
    head = float_layer("float16", k=64, tied=True)
    head.add_row_kernel()
    assert picked(head) == ranges((1, "one_row"), (8, "half_gemv"), (None, "linear" if units else "widened"))


def test_a_bfloat16_layer_on_the_gemv_takes_no_row_kernel():
    layer = float_layer("bfloat16", k=64)
    layer.add_row_kernel()
    assert layer.row_kernel is None and picked(layer)[0] == "half_gemv"


def test_int8(units):
    """1-16 rows: the C++ GEMV (torch's int8 kernel without it); more: the widened weight; with a
    bfloat16 copy, more than 12 rows read the copy; widths not a multiple of 16: widened throughout."""
    layer = float_layer("int8")
    assert picked(layer) == ranges((16, "int8_gemv"), (None, "widened"))
    layer.use_gemv(False)
    assert picked(layer) == ranges((16, "int8pack_mm"), (None, "widened"))
    layer.use_gemv(True)
    layer.add_bf16_copy()
    assert picked(layer) == ranges((12, "int8_gemv"), (None, "bf16_copy"))
    assert picked(float_layer("int8", n=8)) == ranges((16, "int8pack_mm"), (None, "widened"))   # < 16 outputs
    assert picked(float_layer("int8", k=40)) == ranges((None, "widened"))


def test_int8_off_the_cpu_widens_to_the_activations_dtype():
    w = torch.randn(32, 64)
    layer = make_linear(w.to("meta"), None, "int8", device=torch.device("cuda"))
    assert picked(layer) == ranges((None, "dequantized_linear"))


def test_int4_on_the_cpu_runs_q4g():
    """Up to 128 rows the C++ q4g GEMV; more: the dequantized weight in a float32 matmul; with the
    GEMVs off every step dequantizes; with a bfloat16 copy, more than 12 rows read it."""
    layer = float_layer("int4", n=48)
    assert isinstance(layer, quant.Int4GroupLinear)
    assert picked(layer) == ranges((128, "q4g_gemv"), (None, "dequantized_linear"))
    layer.use_gemv(False)
    assert picked(layer) == ranges((None, "dequantized_linear"))
    layer.use_gemv(True)
    layer.add_bf16_copy()
    assert picked(layer) == ranges((12, "q4g_gemv"), (None, "bf16_copy"))


def test_int4_without_kvserves_ops_in_torchs_layout(units, monkeypatch):
    """Where the C++ ops are not built: up to 128 rows torch's int4 kernel; more: the unpacked weight
    in a bfloat16 matmul (float32 without bfloat16 units); with a bfloat16 copy, more than 12 rows
    read it."""
    monkeypatch.setattr(quant, "q4g_kernel", lambda device: False)
    layer = float_layer("int4", n=2 * quant.CPU_INT4_ROWS)
    assert isinstance(layer, quant.Int4PackedLinear)
    many = "unpacked_bf16" if units else "unpacked_f32"
    assert picked(layer) == ranges((128, "int4pack_mm"), (None, many))
    layer.add_bf16_copy()
    assert picked(layer) == ranges((12, "int4pack_mm"), (None, "bf16_copy"))


def test_int4_rows_that_do_not_tile_torchs_layout_keep_nibbles(monkeypatch):
    monkeypatch.setattr(quant, "q4g_kernel", lambda device: False)
    layer = float_layer("int4", n=quant.CPU_INT4_ROWS + 8)
    assert isinstance(layer, quant.Int4NibbleLinear)
    assert picked(layer) == ranges((None, "dequantized_linear"))
    layer.add_bf16_copy()
    assert picked(layer) == ranges((None, "dequantized_linear"))


def test_int8_groups():
    """1-128 rows: the C++ q8g GEMV, then the widened weight, or 128 rows at a time on the GEMV for a
    layer without copies (a tied head); with a bfloat16 copy 1-16 rows on the GEMV, more on the copy;
    without the GEMV torch's formula for 1-16 rows."""
    layer = make_linear(groups(), None, "int8g")
    assert picked(layer) == ranges((128, "q8g_gemv"), (None, "widened"))
    layer.add_bf16_copy()
    assert picked(layer) == ranges((16, "q8g_gemv"), (None, "bf16_copy"))
    head = make_linear(groups(), None, "int8g", copies=False)
    assert picked(head) == ranges((128, "q8g_gemv"), (None, "gemv_chunks"))
    head.use_gemv(False)
    assert picked(head) == ranges((16, "q8g_torch"), (None, "widened"))


def test_the_compiled_regions_split_at_every_bound_a_table_holds(monkeypatch):
    """Each bound of every class's table is one of regions.ROW_BOUNDS, so a compiled region graph
    never spans two kernels."""
    from kvserve.model import regions
    layers = []
    for native in (True, False):
        monkeypatch.setattr(quant, "_native_half_cpu", lambda native=native: native)
        layers += [float_layer(fmt, tied=tied) for fmt in ("float32", "bfloat16", "float16", "int8")
                   for tied in (False, True)]
        layers += [float_layer("int4", n=2 * quant.CPU_INT4_ROWS), make_linear(groups(), None, "int8g"),
                   make_linear(groups(), None, "int8g", copies=False)]
    for layer in list(layers):
        copy = float_layer(layer.fmt) if layer.fmt != "int8g" else make_linear(groups(), None, "int8g")
        copy.add_bf16_copy()
        layers.append(copy)
    bounds = {b for layer in layers for b, _ in layer.kernels if b is not None}
    assert bounds - {1} <= set(regions.ROW_BOUNDS)


CASES = [("float32", {}), ("bfloat16", {}), ("float16", {}), ("float16", {"tied": True}), ("int8", {}),
         ("int8", {"copy": True}), ("int4", {}), ("int4", {"copy": True}), ("int4", {"n": 40})]


@pytest.mark.parametrize("fmt,opts", CASES, ids=[f"{f}-{'-'.join(o)}" for f, o in CASES])
def test_every_kernel_computes_x_w_t_for_the_stored_weight(fmt, opts, units):
    """At a row count in each range of the table, each class's output is x W^T + b over its own
    dequantized weight (tolerances as in test_quant.py: bfloat16 activations in the CPU kernels)."""
    n = opts.get("n", 2 * quant.CPU_INT4_ROWS)
    layer = float_layer(fmt, n=n, tied=opts.get("tied", False))
    if opts.get("copy"):
        layer.add_bf16_copy()
    tol = 1e-4 if fmt == "float32" else 0.08
    for rows in (1, 2, 3, 8, 9, 12, 13, 16, 17, 128, 131):
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
        ref = x.double() @ layer.dequantize(torch.float64).T + layer.bias.double()
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        assert torch.allclose(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=0.02), (rows, fmt)


@pytest.mark.parametrize("kind", ["q8_0", "q5_1", "q6_k"])
@pytest.mark.parametrize("copies,copy", [(True, False), (True, True), (False, False)])
def test_every_int8_group_kernel_computes_x_w_t(kind, copies, copy):
    """As test_gguf_formats.py checks them: float32 sums within 1e-5 of |x| |W|^T, the bfloat16
    copy, and the weight widened to bfloat16 (a CPU with bfloat16 units), within 2^-7."""
    layer = make_linear(groups(kind), None, "int8g", copies=copies)
    if copy:
        layer.add_bf16_copy()
    w = layer.dequantize().double()
    wide_bf16 = copy or (copies and layer.bf16_units)   # copies=False: the head, on the GEMV 128 rows at a time
    for rows in (1, 16, 17, 40, 129):
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
        rel = 2 ** -7 if wide_bf16 and rows > (16 if copy else 128) else 1e-5
        err = (layer(x).double() - x.double() @ w.t()).abs()
        assert (err <= rel * (x.double().abs() @ w.abs().t()) + 1e-30).all(), (rows, kind)


INVARIANT_CASES = [("float32", {}), ("bfloat16", {}), ("float16", {"tied": True}), ("int8", {"copy": True}),
                   ("int4", {"copy": True}), ("int4", {"n": 40})]


@pytest.mark.parametrize("fmt,opts", INVARIANT_CASES, ids=[f"{f}-{'-'.join(o)}" for f, o in INVARIANT_CASES])
def test_row_invariant_layers_give_a_row_the_same_bits_at_every_row_count(fmt, opts):
    """row_invariant(True): one kernel at every row count (the format's GEMV 64 rows a call, or the
    one-row kernel row by row), so each row of a 1..131-row call equals the row alone, bit for bit,
    and stays x W^T + b; row_invariant(False) brings the table back."""
    n = opts.get("n", 2 * quant.CPU_INT4_ROWS)
    layer = float_layer(fmt, n=n, tied=opts.get("tied", False))
    if opts.get("copy"):
        layer.add_bf16_copy()
    table = layer.kernels
    layer.row_invariant(True)
    x = torch.randn(131, layer.in_features, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(131)])
    for rows in (2, 3, 8, 13, 17, 64, 65, 131):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    ref = x.double() @ layer.dequantize(torch.float64).T + layer.bias.double()
    tol = 1e-4 if fmt == "float32" else 0.08
    assert torch.allclose(alone.double(), ref, atol=tol * ref.abs().max().item(), rtol=0.02)
    layer.row_invariant(False)
    assert layer.kernels == table


@pytest.mark.parametrize("kind", ["q8_0", "q5_1", "q6_k"])
def test_row_invariant_int8_groups(kind):
    layer = make_linear(groups(kind), None, "int8g")
    layer.add_bf16_copy()
    layer.row_invariant(True)
    x = torch.randn(70, layer.in_features, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    for rows in (2, 16, 17, 40, 70):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
