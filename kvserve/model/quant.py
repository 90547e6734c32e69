"""Linear layers whose weights stay in their storage format: float32, bfloat16, float16, int8, int4,
and a GGUF's own int8 groups.

One class per format (vLLM's create_weights / apply shape), each a `KeptLinear` holding its own
tensors and building its kernel table once: (max rows, kernel) entries, the first one a step's row
count fits runs, rebuilt only when the layer gains a layout (`add_bf16_copy`, `add_row_kernel`) or
its GEMVs are switched (`use_gemv`). `make_linear` picks the class from the format:
- `FloatLinear` (float32): F.linear.
- `Bf16Linear` / `F16Linear` (`HalfLinear`: a bfloat16 model, the float16 LM head of int8/int4
  models): a one-row row kernel (`add_row_kernel`), kvserve's C++ GEMV up to GEMV_ROWS rows, else
  F.linear; on a CPU without 16-bit units (no AVX512-BF16/AMX) steps of more than HALF_WIDE_ROWS
  (TIED_WIDE_ROWS with a tied float32 embedding, which they then read) rows run in float32.
- `Int8Linear` (int8, one symmetric scale per output channel): on CPU up to SMALL_ROWS rows the C++
  GEMV (with `_weight_int8pack_mm`'s roundings: bfloat16 activations), else `_weight_int8pack_mm`;
  more rows widen the weight inside the matmul (`F.linear(x, q) * scale`, also the CUDA path).
- `Int4GroupLinear` (int4 on a CPU with kvserve's ops: GGUF's nibble order, a float16 scale and min
  per group of GROUP_SIZE inputs: Q4_0 / Q4_1 exactly, Q4_K's sub-blocks rounded): the C++
  `q4g_gemv` (rows quantized to int16 per group, integer dot products, row results independent of
  the row count) up to TILE_ROWS rows, then the weight dequantized for a float32 matmul.
- `Int4PackedLinear` / `Int4NibbleLinear` (`Int4Linear`: bfloat16 scale and zero per group): on a
  CPU without kvserve's ops torch's packed layout (`_weight_int4pack_mm_for_cpu` up to
  TILE_ROWS, then the unpacked weight); off the CPU nibbles unpacked inside the matmul.
- `Int8GroupLinear` (int8 codes in groups of 32 or 16 with float16 scales and mins where the file
  stores them so, else float32: GGUF's Q8_0 / Q5_* / Q6_K, exact): the C++ `q8g_gemv` (integer
  products, as q4g) up to TILE_ROWS rows, then widened (`q8g_dequantize`).
- `Int5GroupLinear` (the 5-bit types Q5_0 / Q5_1 / Q5_K on a CPU with kvserve's ops: 20 bytes a group
  of 32 and the file's scales and mins): the C++ `q5g_gemv` up to TILE_ROWS rows, then the
  weight dequantized for a float32 matmul.
With a bfloat16 copy (the engine's bf16_weight_copy) int8 / int4 steps of more than COPY_ROWS rows,
int8-group steps of more than SMALL_ROWS, run one bfloat16 GEMM on it.
`keep_formats` gives a meta-built model each GGUF tensor in its own layout (`weights="gguf"`, the
CPU default for a GGUF: docs/WEIGHTS.md), a quantized embedding as a `GroupEmbedding`;
`quantize_model` requantizes every linear to one format.

Every widened path applies the kernel's roundings (16-bit inputs and outputs), so a row's result
does not depend on how many rows share its step, except where a bfloat16 GEMM runs (the copy, and
on a CPU with bfloat16 units the int4, 5-bit and int8-group weights widened for a step of many
rows): there the weight is rounded to bfloat16 too.
The row thresholds below are where the measured kernels cross (docs/WEIGHTS.md, "Which kernel runs").
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.cpu import MAX_ROWS as GEMV_MAX_ROWS
from kvserve.model.gguf_blocks import Int4Groups, Int8Groups, KeptTensor, affine, int4_groups
from kvserve.model.graph_code import private_copy

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
GGUF_FORMAT = "gguf"     # each GGUF tensor in the layout of its own block type (gguf_blocks.py)
COPY_FORMATS = ("int8", "int4", "int8g")   # formats that take a bfloat16 copy (add_bf16_copy)
FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GROUP_SIZE = 32
INT8_KERNEL_K = 16       # the CPU int8 kernel needs in_features in multiples of 16 (else: widened path)
SMALL_ROWS = 16          # int8 on CPU: rows up to this use the int8 kernel, more use a widened weight
TILE_ROWS = 128          # GGUF group codes on CPU (the tiled C++ GEMVs q4g / q5g / q8g; torch's int4 kernel
                         # without them): rows up to this run them, more widen the weight for one matmul
COPY_ROWS = 12           # with a bfloat16 copy: more rows than this read it
GEMV_ROWS = {"bfloat16": 8, "float16": 8}   # 16-bit weights on CPU: rows up to this use the C++ GEMV
HALF_WIDE_ROWS = 16      # 16-bit weights on a CPU without 16-bit units: more rows widen to float32
TIED_WIDE_ROWS = 1       # ... or more than this when a float32 copy exists anyway (tied embedding)
# Linears whose weight other code reads directly (MLA's absorbed kv_b_proj): they stay in float.
FLOAT_ONLY = ("kv_b_proj",)
# The LM head keeps 16-bit float weights under int8/int4 (as llama.cpp keeps output.weight at higher
# precision); what each head format costs in quality is measured in docs/WEIGHTS.md.
FLOAT_HEAD = ("lm_head",)
HEAD_FORMAT = "float16"


GEMV_DTYPES = (torch.float32, torch.bfloat16)   # activations the C++ GEMVs take
WIDE_CHUNK = 1 << 22     # int8 groups widened this many weights at a time (a 262144-row head: 64 MiB, not 671)

Kernel = Callable[["KeptLinear", torch.Tensor], torch.Tensor]   # (layer, x [rows, in]) -> [rows, out]


def kernel_table(*entries: tuple[int | None, Kernel | None]) -> tuple[tuple[int | None, Kernel], ...]:
    """The (max rows, kernel) entries a layer runs, in order, the last for any rows (max rows None):
    entries without a kernel, and those no row count can reach, are left out."""
    table, low = [], 0
    for max_rows, kernel in entries:
        if kernel is None or (max_rows is not None and max_rows <= low):
            continue
        table.append((max_rows, kernel))
        if max_rows is None:
            break
        low = max_rows
    return tuple(table)


class KeptLinear(nn.Module):
    """A linear layer whose weight stays in a storage format: y = x W^T + b. One subclass per format
    holds that format's tensors and builds its kernel table (`table`) once, at construction and when
    it gains a layout (a bfloat16 copy, a row kernel); a call runs the table's first kernel whose max
    rows the step fits."""

    fmt = ""
    out_features = in_features = 0
    copies = True    # takes the engine's bfloat16 copy (add_bf16_copy) where its format has one
    widens = False   # its many-row steps widen the weight for the call in C++, near the copy's speed
    gemv = False     # the C++ GEMV ops serve this layer's few-row steps
    invariant = False   # every step on a kernel whose rows do not depend on the row count (row_invariant)
    kernels: tuple[tuple[int | None, Kernel], ...] = ()

    def _setup(self, shape: torch.Size, bias: torch.Tensor | None, device: torch.device) -> None:
        self.out_features, self.in_features = shape
        self.device = device   # where the layer runs: it picks the kernels
        self.bf16_units = not slow_half(device)   # read once: compiled graphs cannot ask the CPU
        self.bias = _bias(bias)
        self.register_buffer("bf16_t", None)   # add_bf16_copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        for max_rows, kernel in self.kernels:
            if max_rows is None or rows <= max_rows:
                return kernel(self, x)
        raise AssertionError("a kernel table ends with an entry for any rows")

    def table(self) -> tuple[tuple[int | None, Kernel], ...]:
        """This layer's (max rows, kernel) table (see kernel_table)."""
        raise NotImplementedError

    def pick_kernels(self) -> None:
        self.kernels = ((None, self.invariant_kernel()),) if self.invariant else self.table()

    def row_invariant(self, on: bool) -> None:
        """The batch-invariant mode: a row's result is the same bits whatever else shares its step
        (`invariant_kernel` at every row count), or back to the fastest kernel per row count."""
        self.invariant = on
        self.pick_kernels()

    def invariant_kernel(self) -> Kernel:
        """The format's C++ GEMV with row-invariant sums, up to its row limit a call, where it serves
        this layer; else the one-row kernel of `table`, row by row."""
        gemv = self.invariant_gemv()
        if gemv is not None:
            return in_chunks(gemv, GEMV_MAX_ROWS)
        return in_chunks(self.table()[0][1], 1)

    def invariant_gemv(self) -> Kernel | None:
        """This format's GEMV called so that a row's sums do not depend on the rows beside it, or None."""
        return None

    def native_form(self, rows: int) -> tuple[str, tuple, int] | None:
        """(kind, (a, b, c), group): the C++ kernel and operands this layer runs for every step of 1 to
        `rows` rows, as the native decode stack (model/native) calls it, or None where it runs another."""
        return None

    def runs(self, kernel: Kernel, rows: int) -> bool:
        """True when every step of 1 to `rows` rows runs `kernel`."""
        return all(self.kernel_for(r) is kernel for r in range(1, rows + 1))

    def kernel_for(self, rows: int) -> Kernel:
        """The kernel a step of `rows` rows runs."""
        return next(k for max_rows, k in self.kernels if max_rows is None or rows <= max_rows)

    def use_gemv(self, on: bool) -> None:
        """Serve few-row steps with the C++ GEMVs (where they are built) or with torch's kernels."""
        self.gemv = on and cpu_gemv(self.device, self.fmt)
        self.pick_kernels()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] as stored, widened to `dtype` (the reference for every kernel)."""
        raise NotImplementedError

    def weight_t(self) -> torch.Tensor:
        """W^T [K, N] in float32: the bfloat16 copy's source."""
        return self.dequantize(torch.float32).t()

    def add_bf16_copy(self) -> None:
        """Keep W^T [K, N] in bfloat16 (the stored weight, rounded once) next to the stored layout:
        steps of many rows (a batched decode, a prefill chunk) run one bfloat16 GEMM on it, at 2
        bytes per weight. Formats without a copy (COPY_FORMATS) and copies=False layers keep none."""
        if self.fmt in COPY_FORMATS and self.copies and self.bf16_t is None:
            self.bf16_t = self.weight_t().to(torch.bfloat16, memory_format=torch.contiguous_format)
            self.pick_kernels()

    def bf16_copy(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.to(torch.bfloat16), self.bf16_t).to(x.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds (weights, scales, kernel layouts, copies, bias)."""
        return sum(t.numel() * t.element_size() for t in [*self.buffers(), *self.parameters()])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def in_chunks(kernel: Kernel, rows: int) -> Kernel:
    """`kernel` called on at most `rows` rows at a time."""
    def run(layer: KeptLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= rows:
            return kernel(layer, x)
        return torch.cat([kernel(layer, part) for part in x.split(rows)])
    return run


def _bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)


class FloatLinear(KeptLinear):
    """W kept as a float32 tensor: F.linear at every row count."""

    fmt = "float32"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | None = None):
        super().__init__()
        w = weight.detach()
        self._setup(w.shape, bias, device or w.device)
        self.register_buffer("weight", w.to(FLOAT_FORMATS[self.fmt]).contiguous())
        self.gemv = cpu_gemv(self.device, self.fmt)
        self.pick_kernels()

    def table(self):
        return kernel_table((None, FloatLinear.linear))

    def native_form(self, rows):
        fits = self.fmt == "float32" and self.runs(FloatLinear.linear, rows)
        return ("float", (self.weight, self.weight, None), 0) if fits else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class HalfLinear(FloatLinear):
    """W kept as a 16-bit float (a bfloat16 model, the float16 LM head of int8/int4 models).
    - a one-row step with a row kernel (add_row_kernel): the group-wise int8 GEMV;
    - up to `gemv_rows` rows on CPU: kvserve's C++ GEMV;
    - on a CPU without 16-bit units, more than `wide_rows` rows run in float32 (reading the tied
      float32 embedding where the LM head shares it, else widening the weight for that call);
    - else F.linear."""

    gemv_rows = 0
    wide_rows = HALF_WIDE_ROWS
    tied = ()          # the tied float32 weight, if any
    row_kernel = None  # add_row_kernel

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, tied: torch.Tensor | None = None,
                 device: torch.device | None = None):
        """`tied`: a float32 tensor holding the same weight that other code keeps anyway (the embedding
        a tied LM head shares); `device`: where the layer runs (default: the weight's)."""
        super().__init__(weight, bias, device)
        if tied is not None:
            # a list, so it is neither a submodule nor counted in this layer's bytes
            self.tied, self.wide_rows = [tied], TIED_WIDE_ROWS
            self.pick_kernels()

    def table(self):
        fits = self.gemv and self.in_features % 32 == 0 and self.out_features >= 16
        return kernel_table((1, HalfLinear.one_row if self.row_kernel is not None else None),
                            (self.gemv_rows, type(self).half_gemv if fits else None),
                            (None if self.bf16_units else self.wide_rows, HalfLinear.linear),
                            (None, HalfLinear.widened))

    def half_gemv(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        raise NotImplementedError

    native_kind = ""   # the native stack's name of half_gemv

    def native_form(self, rows):
        fits = self.runs(type(self).half_gemv, rows)
        return (self.native_kind, (self.weight, self.weight, None), 0) if fits else None

    def invariant_gemv(self):
        fits = self.gemv and self.in_features % 32 == 0 and self.out_features >= 16
        return functools.partial(type(self).half_gemv, invariant=True) if fits else None

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """float32 arithmetic with the 16-bit roundings (16-bit inputs and outputs)."""
        w = self.weight
        if w.dtype == x.dtype:
            return F.linear(x, w)
        tied = self.tied[0] if self.tied and self.tied[0].dtype == torch.float32 else None
        wide = tied if tied is not None else w.float()
        return F.linear(x.to(w.dtype).float(), wide).to(w.dtype).to(x.dtype)

    def one_row(self, x: torch.Tensor) -> torch.Tensor:
        return self.row_kernel(x.float(), self.row_q8, self.row_scale).to(x.dtype)

    def wants_row_kernel(self) -> bool:
        return self.in_features % GROUP_SIZE == 0 and self.weight.device.type == "cpu"

    def add_row_kernel(self) -> None:
        """A compiled kernel for a single row (a one-token step's LM head): the weight as int8 in
        groups of GROUP_SIZE input channels, one float16 scale each (GGUF's Q8_0, which it holds
        exactly when built from a Q8_0 tensor), laid out [K/G, G, N] so the GEMV runs along N; it
        reads half the bytes of float16."""
        if not self.wants_row_kernel():
            return
        w = self.tied[0] if self.tied and self.tied[0].dtype == torch.float32 else self.weight.float()
        groups = w.view(self.out_features, -1, GROUP_SIZE)
        scale = (groups.abs().amax(-1) / 127).to(torch.float16).clamp(min=1e-7)   # [N, K/G]
        q = torch.round(groups / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("row_q8", q.permute(1, 2, 0).contiguous())             # [K/G, G, N]
        self.register_buffer("row_scale", scale.t().contiguous())                   # [K/G, N]
        self.row_kernel = torch.compile(private_copy(_q8_row), dynamic=False, fullgraph=True)
        self.row_kernel(self.weight.new_zeros(1, self.in_features, dtype=torch.float32), self.row_q8, self.row_scale)
        self.pick_kernels()


class Bf16Linear(HalfLinear):
    """W kept as bfloat16 (see HalfLinear); with the C++ GEMV it takes no row kernel (its own weights
    on the GEMV already)."""

    fmt = "bfloat16"
    gemv_rows = GEMV_ROWS["bfloat16"]
    native_kind = "bf16"

    def half_gemv(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return torch.ops.kvserve_cpu.bf16_gemv(x.to(self.weight.dtype).contiguous(), self.weight, invariant).to(x.dtype)

    def wants_row_kernel(self) -> bool:
        return super().wants_row_kernel() and not self.gemv


class F16Linear(HalfLinear):
    """W kept as float16 (see HalfLinear): the LM head of int8/int4 models."""

    fmt = "float16"
    gemv_rows = GEMV_ROWS["float16"]
    native_kind = "f16"

    def half_gemv(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return torch.ops.kvserve_cpu.f16_gemv(x.to(self.weight.dtype).contiguous(), self.weight, invariant).to(x.dtype)


class Int8Linear(KeptLinear):
    """W as int8 codes with one symmetric scale per output channel.
    On CPU: up to SMALL_ROWS rows (in_features a multiple of INT8_KERNEL_K) kvserve's C++ GEMV (with
    `_weight_int8pack_mm`'s roundings: bfloat16 activations), else `_weight_int8pack_mm`; more rows
    widen the weight inside the matmul with the kernel's roundings, or with a bfloat16 copy, steps of
    more than COPY_ROWS rows read it. Elsewhere the weight is widened to the activations' dtype."""

    fmt = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | None = None):
        super().__init__()
        w = weight.detach()
        self._setup(w.shape, bias, device or w.device)
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)                      # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.gemv = cpu_gemv(self.device, self.fmt)
        self.pick_kernels()

    def table(self):
        on_cpu = self.device.type == "cpu"
        small = None
        if on_cpu and self.in_features % INT8_KERNEL_K == 0:
            small = Int8Linear.int8_gemv if self.gemv and self.out_features >= 16 else Int8Linear.int8pack_mm
        many = Int8Linear.widened if on_cpu else Int8Linear.dequantized_linear
        if self.bf16_t is not None:
            return kernel_table((COPY_ROWS, small or many), (None, KeptLinear.bf16_copy))
        return kernel_table((SMALL_ROWS, small), (None, many))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def int8_gemv(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if x.dtype not in GEMV_DTYPES:
            return self.int8pack_mm(x)
        return torch.ops.kvserve_cpu.int8_gemv(x.contiguous(), self.qweight, self.scale_bf16, invariant)

    def invariant_gemv(self):
        fits = self.gemv and self.in_features % INT8_KERNEL_K == 0 and self.out_features >= 16
        return functools.partial(Int8Linear.int8_gemv, invariant=True) if fits else None

    def int8pack_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale_bf16).to(x.dtype)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's roundings (bfloat16 in, bfloat16 scale and out), so a row's result does not
        depend on how many rows share its step."""
        xb = x.to(torch.bfloat16)
        out = F.linear(xb.to(x.dtype), self.qweight.to(x.dtype)) * self.scale_bf16.to(x.dtype)
        return out.to(torch.bfloat16).to(x.dtype)

    def dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)


class Int4Linear(KeptLinear):
    """W as 4-bit codes in groups of GROUP_SIZE input channels, a bfloat16 scale and zero per group
    (w = (q - 8) * scale + zero: the CPU kernel's convention), the layout of GGUF's Q4_1 / Q4_K
    sub-blocks. `int4_linear` picks the layout: Int4PackedLinear on CPU, Int4NibbleLinear elsewhere."""

    fmt = "int4"

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None, device: torch.device | None = None):
        super().__init__()
        q = groups.codes.detach()
        self._setup(q.shape, bias, device or q.device)
        # [K/G, N, 2]
        zeros = torch.stack([groups.scales.t(), (groups.lows + 8 * groups.scales).t()], dim=-1).contiguous()
        self.register_buffer("scales_zeros", zeros.to(torch.bfloat16))
        self._store_codes(q)
        self.gemv = cpu_gemv(self.device, self.fmt)
        self.pick_kernels()

    def _store_codes(self, q: torch.Tensor) -> None:
        raise NotImplementedError

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [N, K] (uint8 0..15)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        groups = self.codes().float().view(n, k // GROUP_SIZE, GROUP_SIZE) - 8
        scale, zero = self.scales_zeros.float().permute(2, 1, 0)                    # [N, K/G] each
        return (groups * scale[..., None] + zero[..., None]).view(n, k).to(dtype)


class Int4PackedLinear(Int4Linear):
    """int4 in torch's CPU packed layout (rows a multiple of CPU_INT4_ROWS), where kvserve's C++ ops
    are not built: `_weight_int4pack_mm_for_cpu` (bfloat16 activations) up to TILE_ROWS rows;
    more rows (a prefill chunk) unpack the weight once and run a bfloat16 matmul where the CPU has
    bfloat16 units (the weight rounded to bfloat16 too), a float32 one where it has not. With a
    bfloat16 copy, steps of more than COPY_ROWS rows read it."""

    def _store_codes(self, q: torch.Tensor) -> None:
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))

    def table(self):
        if self.bf16_t is not None:
            return kernel_table((COPY_ROWS, Int4PackedLinear.int4pack_mm), (None, KeptLinear.bf16_copy))
        unpacked = Int4PackedLinear.unpacked_bf16 if self.bf16_units else Int4PackedLinear.unpacked_f32
        return kernel_table((TILE_ROWS, Int4PackedLinear.int4pack_mm), (None, unpacked))

    def codes(self) -> torch.Tensor:
        return int4_codes_t(self.packed).t().contiguous()

    def weight_t(self) -> torch.Tensor:
        """W^T [K, N] float32 from the packed layout with dequantize's roundings ((q - 8) * scale,
        then + zero), unpacked along N: no transposing copy."""
        k, n = self.in_features, self.out_features
        codes = int4_codes_t(self.packed).float().view(k // GROUP_SIZE, GROUP_SIZE, n) - 8
        scale, zero = (self.scales_zeros[..., i].float().unsqueeze(1) for i in (0, 1))   # [K/G, 1, N]
        return (codes * scale + zero).view(k, n)

    def int4pack_mm(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_zeros).to(x.dtype)

    def unpacked_bf16(self, x: torch.Tensor) -> torch.Tensor:
        w_t = torch.ops.kvserve.int4_weight_t(self.packed, self.scales_zeros)
        return torch.mm(x.to(torch.bfloat16), w_t.to(torch.bfloat16)).to(x.dtype)

    def unpacked_f32(self, x: torch.Tensor) -> torch.Tensor:
        w_t = torch.ops.kvserve.int4_weight_t(self.packed, self.scales_zeros)
        return torch.mm(x.to(torch.bfloat16).float(), w_t).to(torch.bfloat16).to(x.dtype)


class Int4NibbleLinear(Int4Linear):
    """int4 as two codes a byte (off the CPU, or rows that do not tile torch's CPU layout): the groups
    unpacked to the activations' dtype inside the matmul, at every row count (a bfloat16 copy, if
    added, is not read)."""

    def _store_codes(self, q: torch.Tensor) -> None:
        self.register_buffer("nibbles", q[:, 0::2] | (q[:, 1::2] << 4))        # [N, K/2]

    def table(self):
        return kernel_table((None, Int4NibbleLinear.dequantized_linear))

    def codes(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        return torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(n, k)

    def dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))


class PackedGroupLinear(KeptLinear):
    """The CPU layers of GGUF codes packed for kvserve's ops (int4, 5-bit): the class's GEMV
    (`gemv_kernel`) up to TILE_ROWS rows, or COPY_ROWS where the engine keeps a bfloat16 copy
    (then read beyond), else the weight dequantized for the call in a float32 matmul (bfloat16 on a
    CPU with bfloat16 units). With the GEMVs off (`use_gemv(False)`) every step runs the dequantized
    weight."""

    gemv_kernel: Kernel
    widens = True   # q4g_dequantize / q5g_dequantize

    def use_gemv(self, on: bool) -> None:
        self.gemv = on
        self.pick_kernels()

    def table(self):
        gemv = type(self).gemv_kernel if self.gemv else None
        if self.bf16_t is not None:
            return kernel_table((COPY_ROWS, gemv), (None, KeptLinear.bf16_copy))
        return kernel_table((TILE_ROWS, gemv), (None, PackedGroupLinear.dequantized_linear))

    def invariant_gemv(self):
        return type(self).gemv_kernel if self.gemv else None   # its rows are independent already

    def dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.bfloat16 if self.bf16_units else torch.float32
        return F.linear(x.to(wide), self.dequantize(wide)).to(x.dtype)


class Int4GroupLinear(PackedGroupLinear):
    """int4 on a CPU with kvserve's C++ ops: GGUF's 4-bit codes re-laid in tiles of 16 output
    channels (`q4g_tile`: per tile and group of 32 inputs 256 bytes, one vector holding the tile's 16
    channels' codes of a pair of inputs, so the GEMV multiplies sixteen channels in each integer
    product instruction), a float16 scale per group ([N/16, K/32, 16] beside the tiles) and a
    float16 min ([K/32, N]: the GEMV sums sixteen channels' at once): w = code * scale + min (Q4_1
    exactly as the file stores them; Q4_K's sub-block scale and min, d * scale6, rounded to
    float16); Q4_0's centred codes keep no mins (w = (code - 8) * scale: a tenth fewer bytes a step
    reads).
    - up to TILE_ROWS rows (float32 or bfloat16 activations): the C++ `q4g_gemv`, which
      quantizes each row to int16 per group of 32 (llama.cpp's Q8_1 with 16-bit codes: an error of
      1/65534 of the group's largest value) and takes integer dot products; a row's result does not
      depend on the rows beside it;
    - more rows: one bfloat16 GEMM on the bfloat16 copy where the engine keeps one (then from
      COPY_ROWS rows), else the weight dequantized for the call (`q4g_dequantize`) in a float32
      matmul (bfloat16 on a CPU with bfloat16 units).
    With the GEMVs off (`use_gemv(False)`) every step runs the dequantized weight."""

    fmt = "int4"

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None, device: torch.device | None = None):
        super().__init__()
        self._setup(groups.codes.shape, bias, device or groups.codes.device)
        tiles, tile_scales = q4g_tiles(groups.codes, groups.scales.to(torch.float16))
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)
        # [K/32, N]; none where the codes are centred (Q4_0: every min is -8 * scale, so none is read)
        self.register_buffer("mins", None if groups.centered else groups.lows.to(torch.float16).t().contiguous())
        self.gemv = True
        self.pick_kernels()

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [N, K] (uint8 0..15)."""
        t, blocks = self.tiles.shape[:2]
        v = self.tiles.view(t, blocks, 8, TILE, 2)                # [tile, group, quad, channel, input % 2]
        both = torch.stack([v & 15, v >> 4], dim=4)               # [.., channel, input % 4 // 2, input % 2]
        return both.permute(0, 3, 1, 2, 4, 5).reshape(t * TILE, -1)[:self.out_features].contiguous()

    def group_scales(self) -> torch.Tensor:
        """The float16 scale of each channel and group of 32 [N, K/32]."""
        t, blocks = self.tile_scales.shape[:2]
        return self.tile_scales.permute(0, 2, 1).reshape(t * TILE, blocks)[:self.out_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        wide = dtype if dtype in WIDE_DTYPES else torch.float32
        return torch.ops.kvserve_cpu.q4g_dequantize(self.tiles, self.tile_scales, self.mins,
                                                    self.out_features, wide).to(dtype)

    def q4g_gemv(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in GEMV_DTYPES:
            return self.dequantized_linear(x)
        return torch.ops.kvserve_cpu.q4g_gemv(x.contiguous(), self.tiles, self.tile_scales, self.mins, self.out_features)

    gemv_kernel = q4g_gemv

    def native_form(self, rows):
        return ("q4g", (self.tiles, self.tile_scales, self.mins), 0) if self.runs(type(self).gemv_kernel, rows) else None


TILE = 16   # output channels a tile of the C++ GEMVs' codes holds
WIDE_DTYPES = (torch.float32, torch.bfloat16)   # what the C++ dequantizers write
# bytes a tile holds for a block of 32 inputs, per op (gemv.cpp's NibbleTile, FiveBitTile, ByteTile)
TILE_BYTES = {"q4g": 256, "q5g": 320, "q8g": 512}


def meta_tiles(op: str, codes: torch.Tensor, scales: torch.Tensor, group: int = GROUP_SIZE):
    """The shapes of `op`'s tiles and tile scales for codes [N, K] on the meta device (a weight-cache
    build: the ops' meta path imports torch._dynamo)."""
    n, k = codes.shape
    t = -(-n // TILE)
    return (torch.empty((t, k // GROUP_SIZE, TILE_BYTES[op]), dtype=torch.uint8, device="meta"),
            torch.empty((t, k // group, TILE), dtype=scales.dtype, device="meta"))


def q4g_tiles(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes [N, K] and float16 scales [N, K/32] as q4g_gemv's tiles and tile scales."""
    if codes.is_meta:
        return meta_tiles("q4g", codes, scales)
    return torch.ops.kvserve_cpu.q4g_tile(gguf_nibbles(codes), scales.contiguous())


def gguf_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 0..15) in GGUF's nibble order [N, K/2]: per group of 32 inputs, 16
    bytes, input i in byte i's low nibble and input 16 + i in its high nibble."""
    n, k = codes.shape
    if codes.is_meta:   # a weight-cache build: the shape (the ops' meta path imports torch._dynamo)
        return torch.empty((n, k // 2), dtype=torch.uint8, device="meta")
    v = codes.view(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def int4_linear(weight: torch.Tensor | Int4Groups, bias: torch.Tensor | None = None,
                device: torch.device | None = None) -> Int4Linear:
    """The int4 layer for `weight` (a float weight is grouped first): kvserve's own CPU layout where its
    ops are built, else packed for torch's CPU kernels where its rows tile their block, else nibbles."""
    groups = weight if isinstance(weight, Int4Groups) else int4_groups(weight.detach())
    device = device or groups.codes.device
    if q4g_kernel(device):
        return Int4GroupLinear(groups, bias, device)
    packs = device.type == "cpu" and groups.codes.shape[0] % CPU_INT4_ROWS == 0
    return (Int4PackedLinear if packs else Int4NibbleLinear)(groups, bias, device)


HALF_CLASSES = {"bfloat16": Bf16Linear, "float16": F16Linear}


def make_linear(weight: torch.Tensor | Int4Groups | Int8Groups, bias: torch.Tensor | None, fmt: str,
                tied: torch.Tensor | None = None, device: torch.device | None = None,
                copies: bool = True) -> KeptLinear:
    """The layer class of `fmt` holding `weight` (a float tensor, or a GGUF layout: Int4Groups for
    int4, Int8Groups for int8g), to run on `device` (default: the weight's; a model built on the meta
    device for the weight cache passes the device it will run on). `tied`: the float32 weight a
    16-bit LM head shares with the embedding; `copies`: whether an int8g layer takes a bfloat16 copy."""
    if fmt in HALF_CLASSES:
        return HALF_CLASSES[fmt](weight, bias, tied, device)
    if fmt == "float32":
        return FloatLinear(weight, bias, device)
    if fmt == "int8":
        return Int8Linear(weight, bias, device)
    if fmt == "int4":
        return int4_linear(weight, bias, device)
    if fmt == "int8g" and copies and five_bit_layer(weight, device or weight.codes.device):
        return Int5GroupLinear(weight, bias, device)
    if fmt == "int8g":
        device = device or weight.codes.device
        tiled = q8g_kernel(device) and weight.codes.shape[1] % GROUP_SIZE == 0
        return (Int8GroupLinear if tiled else Int8CodesLinear)(weight, bias, copies, device)
    raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")


class Int8GroupLinear(KeptLinear):
    """W as int8 codes in groups along the input channels, a scale per group (and a minimum where the
    GGUF type has one), float16 where the file stores them so (Q8_0 / Q5_0 / Q5_1), else float32:
    GGUF's Q8_0 / Q5_0 / Q5_1 / Q5_K (groups of 32) and Q6_K (16), held exactly (gguf_blocks.py).
    Where kvserve's C++ GEMV runs it (CPU, in_features a multiple of 32) the codes and scales are kept
    in tiles of 16 output channels (`q8g_tile`: per tile and block of 32 inputs 512 bytes, a pair of
    inputs' codes for the sixteen channels in 32 bytes), elsewhere as [N, K] codes (Int8CodesLinear).
    - up to TILE_ROWS rows (float32 or bfloat16 activations): kvserve's C++ GEMV `q8g_gemv` on CPU
      (the rows quantized to int16 per block of 32 and multiplied in integers, as `q4g_gemv`: a row's
      result does not depend on the rows beside it), SMALL_ROWS where the engine keeps a bfloat16 copy;
      without the C++ GEMV the same formula in torch up to SMALL_ROWS;
    - more rows: one bfloat16 GEMM on the bfloat16 copy when the engine keeps one (add_bf16_copy),
      else the weight widened for the call (`q8g_dequantize`; without it to float32, the activations'
      dtype off the CPU, WIDE_CHUNK weights at a time).
    `copies=False` (a tied LM head, whose copy would be the largest tensor of a small model): no
    bfloat16 copy; its steps of more rows run the C++ GEMV TILE_ROWS rows at a time."""

    fmt = "int8g"

    def __init__(self, groups: Int8Groups, bias: torch.Tensor | None = None, copies: bool = True,
                 device: torch.device | None = None, held: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`device`: where the layer runs, default the codes'; `held`: the two tensors to keep as they
        are (a tied head's: the embedding's own tiles), `groups` then giving the shape, group and mins."""
        super().__init__()
        self.copies = copies
        self._setup(groups.codes.shape, bias, device or groups.codes.device)
        self.group = groups.group
        scales = scale_tensor(groups.scales)
        if held is None:
            held = q8g_tiles(groups.codes.contiguous(), scales.contiguous(), self.group)
        self._store(*held)
        # [K/G, N], the scales' dtype: the GEMV sums eight channels' mins at once
        self.register_buffer("mins_t", None if groups.mins is None else groups.mins.to(scales.dtype).t().contiguous())
        self.use_gemv(True)

    def _store(self, tiles: torch.Tensor, tile_scales: torch.Tensor) -> None:
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)

    def codes_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes [N, K] (int8) and scales [N, K/G], read back from the tiles."""
        return tile_rows(self.tiles, self.tile_scales, torch.arange(self.out_features))

    @property
    def mins(self) -> torch.Tensor | None:
        """The mins [N, K/G] (a view of mins_t), or None."""
        return None if self.mins_t is None else self.mins_t.t()

    def use_gemv(self, on: bool) -> None:
        self.gemv = on and q8g_kernel(self.device)
        self.pick_kernels()

    @property
    def widens(self) -> bool:
        return self.gemv   # q8g_dequantize, with the GEMVs

    def table(self):
        few = Int8GroupLinear.q8g_gemv if self.gemv else Int8GroupLinear.q8g_torch
        if self.bf16_t is not None:
            return kernel_table((SMALL_ROWS, few), (None, KeptLinear.bf16_copy))
        # the head (run eagerly) stays on the GEMV, another layer widens its weight for the call (C++;
        # a fixed graph for any row count)
        many = Int8GroupLinear.gemv_chunks if self.gemv and not self.copies else Int8GroupLinear.widened
        return kernel_table((TILE_ROWS if self.gemv else SMALL_ROWS, few), (None, many))

    def groups(self) -> Int8Groups:
        return Int8Groups(*self.codes_scales(), self.mins, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.groups().dequantize(dtype)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve_cpu.q8g_gemv(x.contiguous(), self.tiles, self.tile_scales, self.mins_t, self.group,
                                              self.out_features)

    def q8g_gemv(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in GEMV_DTYPES:
            return self.kernels[-1][1](self, x)   # the many-row kernel
        return self._gemv(x)

    def invariant_gemv(self):
        return Int8GroupLinear.q8g_gemv if self.gemv else None   # its rows are independent already

    def native_form(self, rows):
        fits = self.runs(Int8GroupLinear.q8g_gemv, rows)
        return ("q8g", (self.tiles, self.tile_scales, self.mins_t), self.group) if fits else None

    def q8g_torch(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in GEMV_DTYPES:
            return self.kernels[-1][1](self, x)   # the many-row kernel
        codes, scales = self.codes_scales()
        return _q8g_torch(x.contiguous(), codes, scales, self.mins, self.group)

    def gemv_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """TILE_ROWS rows at a time on the GEMV (eager callers only: the chunk count follows the rows)."""
        if x.dtype not in GEMV_DTYPES:
            return self.widened(x)
        return torch.cat([self._gemv(part) for part in x.split(TILE_ROWS)])

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """The weight widened for the call: to bfloat16 on a CPU with bfloat16 units (as the bfloat16
        copy holds it) by the C++ `q8g_dequantize` where it is built, float32 on another CPU, the
        activations' dtype elsewhere (a chunk at a time where the C++ op does not widen it)."""
        wide = x.dtype if x.device.type != "cpu" else torch.bfloat16 if self.bf16_units else torch.float32
        if self.gemv:
            w = torch.ops.kvserve_cpu.q8g_dequantize(self.tiles, self.tile_scales, self.mins_t, self.group,
                                                     self.out_features, wide)
            return F.linear(x.to(wide), w).to(x.dtype)
        return torch.cat([F.linear(x.to(wide), w) for w in self._widened(wide)], dim=-1).to(x.dtype)

    def _widened(self, dtype: torch.dtype):
        """The weight in row chunks of about WIDE_CHUNK values, each [rows, in] in `dtype`."""
        step = max(1, WIDE_CHUNK // self.in_features)
        codes, scales = self.codes_scales()
        for start in range(0, self.out_features, step):
            rows = slice(start, start + step)
            mins = None if self.mins is None else self.mins[rows]
            yield affine(codes[rows], scales[rows], mins, self.group).to(dtype)

    def add_bf16_copy(self) -> None:
        """Keep W^T [K, N] in bfloat16 (widened a chunk at a time) for steps of more than SMALL_ROWS rows."""
        if self.bf16_t is None and self.copies:
            self.bf16_t = torch.cat([w.t() for w in self._widened(torch.bfloat16)], dim=1).contiguous()
            self.pick_kernels()


class Int8CodesLinear(Int8GroupLinear):
    """Int8GroupLinear where kvserve's C++ GEMV does not run it (another device, no C++ build, or
    in_features not a multiple of 32): the codes [N, K] and scales [N, K/G] as GGUF's blocks give them,
    every step on torch's formula or the widened weight."""

    def __init__(self, groups: Int8Groups, bias: torch.Tensor | None = None, copies: bool = True,
                 device: torch.device | None = None):
        codes, scales = groups.codes.contiguous(), scale_tensor(groups.scales).contiguous()
        super().__init__(groups, bias, copies, device, held=(codes, scales))

    def _store(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def codes_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales

    def use_gemv(self, on: bool) -> None:
        self.gemv = False
        self.pick_kernels()


def tile_rows(tiles: torch.Tensor, tile_scales: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of the int8 codes [len, K] and scales [len, K/G] held in q8g tiles."""
    t, blocks = tiles.shape[:2]
    pairs = tiles.view(torch.int8).view(t, blocks, 16, TILE, 2)   # [tile, block, pair, channel, input % 2]
    tile, lane = rows // TILE, rows % TILE
    codes = pairs[tile, :, :, lane, :].reshape(len(rows), blocks * GROUP_SIZE)
    return codes, tile_scales[tile, :, lane]


def q8g_tiles(codes: torch.Tensor, scales: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and scales [N, K/group] as q8g_gemv's tiles and tile scales."""
    if codes.is_meta:
        return meta_tiles("q8g", codes, scales, group)
    return torch.ops.kvserve_cpu.q8g_tile(codes, scales, group)


class Int5GroupLinear(PackedGroupLinear):
    """GGUF's 5-bit types (Q5_0, Q5_1, Q5_K: Int8Groups of 5-bit codes in groups of 32) on a CPU with
    kvserve's C++ ops: the codes in tiles of 16 output channels (`q5g_tile`: per tile and group of 32
    inputs q4g's 256 bytes of low four bits and 64 bytes of fifth bits, 20 bytes a channel's group),
    the scales as kept (float16 for Q5_0 / Q5_1, Q5_K's products float32) beside them and a min per
    group: w = code * scale + min, as the file's values; Q5_0 (signed codes) keeps no mins:
    w = (code - 16) * scale.
    - up to TILE_ROWS rows: the C++ `q5g_gemv` (integer products, as q4g: a row's result does not
      depend on the rows beside it);
    - more rows: the bfloat16 copy from COPY_ROWS where the engine keeps one, else the weight
      dequantized for the call (`q5g_dequantize`) in a float32 matmul."""

    fmt = "int8g"

    def __init__(self, groups: Int8Groups, bias: torch.Tensor | None = None, device: torch.device | None = None):
        super().__init__()
        self._setup(groups.codes.shape, bias, device or groups.codes.device)
        centered = groups.mins is None   # a signed type (Q5_0): w = (code - 16) * scale, no min to read
        groups = groups.unsigned()
        scales = scale_tensor(groups.scales)
        tiles, tile_scales = q5g_tiles(groups.codes, scales)
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)
        self.register_buffer("mins_t", None if centered else groups.mins.to(scales.dtype).t().contiguous())   # [K/32, N]
        self.gemv = True
        self.pick_kernels()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        wide = dtype if dtype in WIDE_DTYPES else torch.float32
        return torch.ops.kvserve_cpu.q5g_dequantize(self.tiles, self.tile_scales, self.mins_t,
                                                    self.out_features, wide).to(dtype)

    def q5g_gemv(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in GEMV_DTYPES:
            return self.dequantized_linear(x)
        return torch.ops.kvserve_cpu.q5g_gemv(x.contiguous(), self.tiles, self.tile_scales, self.mins_t,
                                              self.out_features)

    gemv_kernel = q5g_gemv

    def native_form(self, rows):
        form = ("q5g", (self.tiles, self.tile_scales, self.mins_t), 0)
        return form if self.runs(type(self).gemv_kernel, rows) else None


FIVE_BITS = 5


def five_bit_layer(groups: Int8Groups, device: torch.device) -> bool:
    """True when `groups` (5-bit codes in groups of 32) runs as an Int5GroupLinear on `device`."""
    return (groups.bits == FIVE_BITS and groups.group == GROUP_SIZE and groups.codes.shape[1] % GROUP_SIZE == 0
            and q5g_kernel(device))


def q5g_tiles(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """5-bit codes [N, K] (0..31) and scales [N, K/32] as q5g_gemv's tiles and tile scales."""
    if codes.is_meta:
        return meta_tiles("q5g", codes, scales)
    return torch.ops.kvserve_cpu.q5g_tile(codes.to(torch.uint8).contiguous(), scales.contiguous())


def _q8_row(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [1, K] times the group-wise int8 weight q [K/G, G, N] (scales [K/G, N]) -> [1, N] float32."""
    groups, size, n = q.shape
    return ((q.float() * x.view(groups, size, 1)).sum(1) * scale.float()).sum(0, keepdim=True)


@torch.library.custom_op("kvserve::int4_weight_t", mutates_args=())
def int4_weight_t(packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """W^T [K, N] in float32 from the CPU int4 kernel's layout (an op of its own, so a compiled graph
    calls it as is: unpacking per element in generated code runs several times slower)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = int4_codes_t(packed).view(k // GROUP_SIZE, GROUP_SIZE, n)
    scale, zero = (scales_zeros[..., i].float().unsqueeze(1) for i in (0, 1))      # [K/G, 1, N]
    return torch.addcmul(zero - 8 * scale, codes.float(), scale).view(k, n)


def int4_codes_t(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes transposed, [K, N] uint8, from the CPU int4 kernel's layout: per block of B rows
    (CPU_INT4_ROWS), per input channel, B/2 bytes (row r in the low nibble, row r + B/2 in the high)."""
    n, k, b = packed.shape[0], packed.shape[1] * 2, CPU_INT4_ROWS
    v = packed.view(n // b, k, b // 2)
    return torch.cat([v & 15, v >> 4], dim=2).permute(1, 0, 2).reshape(k, n)


def cpu_int4_rows() -> int:
    """Rows per block of torch's CPU int4 layout: four of its float vectors (64 under AVX512, 32 under
    AVX2 and elsewhere), read from how it packs a probe (row 32 shares row 0's byte only in blocks of 64)."""
    probe = torch.zeros(64, GROUP_SIZE, dtype=torch.int32)
    probe[32] = 1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    return 64 if int(packed[0, 0]) == 0x10 else 32


# read once at import: a plain int that compiled graphs take as a constant (the probe cannot be traced)
CPU_INT4_ROWS = cpu_int4_rows()


@int4_weight_t.register_fake
def _(packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    return packed.new_empty((packed.shape[1] * 2, packed.shape[0]), dtype=torch.float32)


def cpu_gemv(device: torch.device, fmt: str) -> bool:
    """True when the C++ GEMV ops serve `fmt` layers on `device` (built here on first need)."""
    if device.type != "cpu" or fmt not in ("int8", "int4", "bfloat16", "float16"):
        return False
    from kvserve.model import cpu
    return cpu.available()


def slow_half(device: torch.device) -> bool:
    """True on a CPU without native 16-bit float arithmetic (no AVX512-BF16, no AMX)."""
    return device.type == "cpu" and not _native_half_cpu()


@functools.cache
def _native_half_cpu() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def scale_tensor(scales: torch.Tensor) -> torch.Tensor:
    """Group scales as kept: float16 as given (Q8_0 / Q5_0 / Q5_1: the file's values, two bytes a group),
    else float32."""
    return scales if scales.dtype == torch.float16 else scales.float()


def _q8g_torch(x, codes, scales, mins, group):
    """q8g_gemv's formula in torch: y = sum_g scale * dot(x_g, code_g) + min * sum(x_g), float32 sums."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    out = []
    for start in range(0, codes.shape[0], max(1, WIDE_CHUNK // k)):
        rows = slice(start, start + max(1, WIDE_CHUNK // k))
        c = codes[rows].float().view(-1, k // group, group)
        y = (torch.einsum("mgi,ngi->mng", xg, c) * scales[rows].float()).sum(-1)
        if mins is not None:
            y = y + xg.sum(-1) @ mins[rows].float().t()
        out.append(y)
    return torch.cat(out, dim=-1).to(x.dtype)


def q4g_kernel(device: torch.device) -> bool:
    """True when the C++ `q4g_gemv` serves int4 layers on `device`."""
    return cpu_gemv(device, "int4") and hasattr(torch.ops.kvserve_cpu, "q4g_gemv")


def q5g_kernel(device: torch.device) -> bool:
    """True when the C++ `q5g_gemv` serves 5-bit int8-group layers on `device`."""
    return cpu_gemv(device, "int8") and hasattr(torch.ops.kvserve_cpu, "q5g_gemv")


def q8g_kernel(device: torch.device) -> bool:
    """True when the C++ `q8g_gemv` serves int8-group layers on `device`."""
    return cpu_gemv(device, "int8") and hasattr(torch.ops.kvserve_cpu, "q8g_gemv")


class GroupEmbedding(nn.Module):
    """An embedding table kept as int8 groups (a GGUF's quantized token_embd): a lookup widens
    only the rows it reads, to `dtype`; a tied LM head (`tied_head`) reads the same codes."""

    def __init__(self, groups: Int8Groups, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = groups.codes.shape
        self.group, self.dtype = groups.group, dtype
        scales = scale_tensor(groups.scales)
        self._store(groups.codes.contiguous(), scales.contiguous())
        self.register_buffer("mins", None if groups.mins is None else groups.mins.to(scales.dtype).contiguous())

    def _store(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales of token ids `flat`."""
        return self.codes[flat], self.scales[flat]

    def groups(self) -> Int8Groups:
        return Int8Groups(*self.rows(torch.arange(self.num_embeddings)), self.mins, self.group)

    def tied_head(self, device: torch.device | None) -> KeptLinear:
        """The LM head over this table's codes (no copy)."""
        return make_linear(self.groups(), None, "int8g", device=device, copies=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        mins = None if self.mins is None else self.mins[flat]
        rows = affine(*self.rows(flat), mins, self.group)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)


class TiledEmbedding(GroupEmbedding):
    """A GroupEmbedding whose codes and scales sit in q8g_gemv's tiles (where the C++ GEMV runs the
    tied LM head): a lookup gathers its rows from them, the head multiplies by them in place."""

    def _store(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        tiles, tile_scales = q8g_tiles(codes, scales, self.group)
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)

    def rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tile_rows(self.tiles, self.tile_scales, flat)

    def groups(self) -> Int8Groups:
        shape = (self.num_embeddings, self.embedding_dim)   # the head's shape: its codes are the tiles
        return Int8Groups(torch.empty(shape, dtype=torch.int8, device="meta"),
                          torch.empty(0, dtype=self.tile_scales.dtype, device="meta"), self.mins, self.group)

    def tied_head(self, device: torch.device | None) -> KeptLinear:
        return Int8GroupLinear(self.groups(), None, copies=False, device=device or self.tiles.device,
                               held=(self.tiles, self.tile_scales))


def group_embedding(groups: Int8Groups, device: torch.device) -> GroupEmbedding:
    """The embedding for a quantized table on `device`: tiled where the C++ GEMV runs a head over it."""
    tiled = q8g_kernel(device) and groups.codes.shape[1] % GROUP_SIZE == 0
    return (TiledEmbedding if tiled else GroupEmbedding)(groups)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 groups of {self.group}"


class FusedMember(nn.Module):
    """One linear of a quantized `Fused` group: its rows of the group's output (no weight of its own)."""

    def __init__(self, group, index: int):
        super().__init__()
        self.group, self.index = [group], index   # a list: the group is not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group[0](x)[self.index]


def quantize_model(model: nn.Module, fmt: str) -> None:
    """Replace every linear layer of `model` (fused groups first) by the layer class of `fmt`."""
    members = set()
    embeddings = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in list(model.modules()):
        for group in getattr(module, "fused", ()):
            if group.weight is not None:
                group.quant = make_linear(group.weight, group.bias, fmt)
                group.weight = group.bias = None
                members.update(id(m) for m in group.linears)
                _replace_members(module, group)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child) not in members and name not in FLOAT_ONLY:
                head = name in FLOAT_HEAD and fmt not in FLOAT_FORMATS
                tied = embeddings.get(id(child.weight)) if head else None
                setattr(parent, name, make_linear(child.weight, child.bias, HEAD_FORMAT if head else fmt, tied))


def row_invariant_model(model: nn.Module) -> None:
    """The batch-invariant mode: every linear on its row-invariant kernel (KeptLinear.row_invariant);
    float layers still plain (nn.Linear, float fused groups) become their dtype's kept class first."""
    plain = any(isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in FLOAT_ONLY
                for name, m in model.named_modules())
    plain |= any(g.weight is not None for m in model.modules() for g in getattr(m, "fused", ()))
    if plain:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        quantize_model(model, next(name for name, d in FLOAT_FORMATS.items() if d == dtype))
    for layer in quant_layers(model):
        layer.row_invariant(True)


def _replace_members(module: nn.Module, group) -> None:
    for name, child in list(module.named_children()):
        for i, linear in enumerate(group.linears):
            if child is linear:
                setattr(module, name, FusedMember(group, i))


def keep_formats(model: nn.Module, kept: dict[str, KeptTensor], device: torch.device | None = None) -> None:
    """Give `model` (built on the meta device, its float tensors loaded) a layer per GGUF weight in
    `kept` (HF name -> its kept layout): every fused group and linear, the embedding, a tied LM
    head on the embedding's own codes. `device`: where the layers run (make_linear's), default
    the layouts' own."""
    names = {id(m): name for name, m in model.named_modules()}

    def weight(module: nn.Module) -> KeptTensor:
        key = names[id(module)] + ".weight"
        if key not in kept:
            raise ValueError(f"checkpoint does not match the model: no GGUF tensor for {key}")
        return kept[key]
    for module in list(model.modules()):
        for group in getattr(module, "fused", ()):
            _keep_group(module, group, [weight(m) for m in group.linears], device)
    old = model.model.embed_tokens.weight
    table = weight(model.model.embed_tokens).layout
    if isinstance(table, torch.Tensor):
        model.model.embed_tokens.weight = nn.Parameter(table, requires_grad=False)
    else:
        table = table.as_int8() if isinstance(table, Int4Groups) else table
        model.model.embed_tokens = group_embedding(table, device or table.codes.device)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight is old:     # a tied LM head
                setattr(parent, name, _tied_head(child, model.model.embed_tokens, device))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, kept_layer(weight(child), child.bias, device))


def _keep_group(module: nn.Module, group, members: list[KeptTensor], device: torch.device | None) -> None:
    """A fused group as one layer when fuse_kept can join its members (and all or none have a bias),
    else member by member."""
    fused = fuse_kept(members)
    biases = [m.bias for m in group.linears]
    if fused is not None and len({b is None for b in biases}) == 1:
        group.quant = kept_layer(fused, None if biases[0] is None else torch.cat(biases), device)
        _replace_members(module, group)
        return
    layers = [kept_layer(t, b, device) for t, b in zip(members, biases)]
    for name, child in list(module.named_children()):
        if child in group.linears:
            setattr(module, name, layers[group.linears.index(child)])
    group.linears = tuple(layers)


def _tied_head(head: nn.Linear, embed: nn.Module, device: torch.device | None) -> nn.Module:
    """The LM head over the embedding's own weight: its codes (no copy), or its float tensor."""
    if isinstance(embed, GroupEmbedding):
        return embed.tied_head(device)
    head.weight = embed.weight
    return head


def kept_layer(t: KeptTensor, bias: torch.Tensor | None, device: torch.device | None = None) -> KeptLinear:
    """The layer holding one kept GGUF weight, to run on `device` (default: the layout's)."""
    fmt = str(t.layout.dtype).removeprefix("torch.") if t.kind == "float" else t.kind
    return make_linear(t.layout, bias, fmt, device=device)


def fuse_kept(members: list[KeptTensor]) -> KeptTensor | None:
    """The members' rows in one layout (see keep_formats), or None when their layouts differ."""
    kinds = {t.kind for t in members}
    types = "+".join(dict.fromkeys(t.gguf_type for t in members))
    layouts = [t.layout for t in members]
    if kinds == {"int8g"}:
        g = min(x.group for x in layouts)
        bits = max(x.bits for x in layouts)
        parts = [x.regroup(g) for x in layouts]
        if bits == FIVE_BITS and any(p.mins is not None for p in parts):   # one 5-bit layer: codes from 0, mins
            parts = [p.unsigned() for p in parts]
        mins = None
        if any(p.mins is not None for p in parts):
            mins = _rows([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
        return KeptTensor(types, Int8Groups(_rows([p.codes for p in parts]),
                                            _rows([p.scales for p in parts]), mins, g, bits))
    if kinds == {"int4"}:
        return KeptTensor(types, Int4Groups(*(_rows([getattr(x, f) for x in layouts]) for f in ("codes", "scales", "lows")),
                                            centered=all(x.centered for x in layouts)))
    if kinds == {"float"} and len({x.dtype for x in layouts}) == 1:
        return KeptTensor(types, _rows(layouts))
    return None


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows in one tensor; on the meta device (a weight-cache build) only the shape:
    torch.cat's meta path imports torch._dynamo, a second of start-up before the first token. Parts
    of two dtypes (float16 and float32 scales) give the wider."""
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
    if parts[0].is_meta:
        return torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, device="meta")
    return torch.cat([p.to(dtype) for p in parts])


def quant_layers(model: nn.Module) -> list[KeptLinear]:
    """Every kept-format linear of `model`, those of fused groups (not submodules) included."""
    out = [m for m in model.modules() if isinstance(m, KeptLinear)]
    for module in model.modules():
        out += [g.quant for g in getattr(module, "fused", ()) if g.quant is not None]
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and quantized weight layout (shared tensors counted once)."""
    kept = [*quant_layers(model), *(m for m in model.modules() if isinstance(m, GroupEmbedding))]
    tensors = [*model.parameters(), *(b for m in kept for b in m.buffers())]
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating parameter and buffer outside the kept-format layers to `dtype`."""
    for module in model.modules():
        if isinstance(module, GroupEmbedding):
            module.dtype = dtype
        if isinstance(module, (KeptLinear, GroupEmbedding)):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(module, name, b.to(dtype))
