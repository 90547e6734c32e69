"""GGUF weight blocks decoded straight into the layouts kvserve keeps (no float32 round trip).

Each block type has one kept layout (docs/WEIGHTS.md):
- int8 groups (`Int8Groups`): int8 codes [N, K], a float32 scale per group of input channels and,
  where the type has one, a float32 minimum: w = code * scale (+ min). Q8_0, Q5_0, Q5_1, Q5_K
  (groups of 32) and Q6_K (groups of 16). Exact: the float32 products are gguf's own, so
  `dequantize()` equals `gguf.quants.dequantize` bit for bit.
- int4 groups of 32 (`Int4Groups`): 4-bit codes with a float32 scale and low per group:
  w = code * scale + low. Q4_0, Q4_1, Q4_K; exact in float32 (the CPU int4 layer keeps scale and
  low in float16: Q4_0 / Q4_1's own values, Q4_K's sub-block products rounded).
- float: F32, F16, BF16 as they are.
Types without a kernel here (Q2_K, Q3_K, IQ*, TQ*, MXFP4, ...) are dequantized by gguf and
requantized to the nearest kept layout: int4 up to INT4_MAX_BITS bits per weight, int8 groups of 32
above; `KeptTensor.note` says so for the start-up log.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32                 # input channels per group of the int4 layout and of most int8 types
INT4_MAX_BITS = 4.5     # a type without a kernel at up to this many bits per weight maps to int4
CHUNK_BLOCKS = 1 << 16  # blocks decoded at a time (bounds the temporaries of a large tensor)


@dataclass
class Int8Groups:
    """int8 codes [N, K], scales [N, K / group] (float16 where the GGUF type stores them so, else float32),
    mins like scales or None: w = code * scale (+ min). `bits`: how wide the codes are (CODE_BITS):
    a signed type's span -2^(bits-1) .. 2^(bits-1) - 1 and have no mins (Q5_0, Q6_K), an unsigned
    one's 0 .. 2^bits - 1 with mins (Q5_1, Q5_K)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    bits: int = 8

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] (float32 products and sums, then `dtype`)."""
        return affine(self.codes, self.scales, self.mins, self.group).to(dtype)

    def regroup(self, group: int) -> Int8Groups:
        """The same weight in groups of `group` (a divisor of this group: scales repeat, exactly)."""
        if group == self.group:
            return self
        rep = self.group // group
        mins = None if self.mins is None else self.mins.repeat_interleave(rep, dim=1)
        return Int8Groups(self.codes, self.scales.repeat_interleave(rep, dim=1), mins, group, self.bits)

    def unsigned(self) -> Int8Groups:
        """The same weight with codes from 0 and mins (a signed type's codes raised by 2^(bits-1), its
        mins -2^(bits-1) * scale, exact in the scales' dtype); an unsigned one as it is."""
        if self.mins is not None or self.bits >= 8:
            return self
        half = 1 << (self.bits - 1)
        return Int8Groups(self.codes + half, self.scales, self.scales * -half, self.group, self.bits)

    def permute_rows(self, perm) -> Int8Groups:
        """Rows reordered by `perm` (a function of an [N, ...] array)."""
        return Int8Groups(perm(self.codes), perm(self.scales), None if self.mins is None else perm(self.mins),
                          self.group, self.bits)

    @property
    def nbytes(self) -> int:
        """As the CPU layer holds it: 5-bit codes packed (5/8 of a byte each, with mins), else a byte a code."""
        if self.bits == 5:   # a signed type's layer (Q5_0) keeps no mins: its codes are centred
            mins = 0 if self.mins is None else self.scales.numel() * self.scales.element_size()
            return self.codes.numel() * 5 // 8 + self.scales.numel() * self.scales.element_size() + mins
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


@dataclass
class Int4Groups:
    """4-bit codes [N, K] (uint8 0..15), scales and lows [N, K / 32] float32: w = code * scale + low.
    `centered`: every low is -8 * scale (Q4_0), so a layer can keep no lows: w = (code - 8) * scale."""

    codes: torch.Tensor
    scales: torch.Tensor
    lows: torch.Tensor
    group: int = QK
    centered: bool = False

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return affine(self.codes, self.scales, self.lows, self.group).to(dtype)

    def as_int8(self) -> Int8Groups:
        """The same codes as int8 groups with mins (exact; one byte a code: an embedding's rows)."""
        return Int8Groups(self.codes.to(torch.int8), self.scales, self.lows, self.group)

    def permute_rows(self, perm) -> Int4Groups:
        return Int4Groups(perm(self.codes), perm(self.scales), perm(self.lows), self.group, self.centered)

    @property
    def nbytes(self) -> int:   # as the int4 layer holds it: half a byte a code, float16 scale (and min)
        return self.codes.numel() // 2 + 2 * (1 if self.centered else 2) * self.scales.numel()


@dataclass
class KeptTensor:
    """One GGUF weight in its kept layout; `note` says why a type was mapped to another layout."""

    gguf_type: str
    layout: Int8Groups | Int4Groups | torch.Tensor
    note: str = ""

    @property
    def kind(self) -> str:
        """'int8g', 'int4' or 'float'."""
        return {Int8Groups: "int8g", Int4Groups: "int4"}.get(type(self.layout), "float")

    @property
    def shape(self) -> tuple[int, int]:
        t = self.layout if isinstance(self.layout, torch.Tensor) else self.layout.codes
        return tuple(t.shape)

    @property
    def nbytes(self) -> int:
        t = self.layout
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes

    def dequantize(self) -> torch.Tensor:
        t = self.layout
        return t.float() if isinstance(t, torch.Tensor) else t.dequantize()

    def permute_rows(self, perm) -> KeptTensor:
        t = self.layout
        return KeptTensor(self.gguf_type, perm(t) if isinstance(t, torch.Tensor) else t.permute_rows(perm), self.note)

    def to(self, device: torch.device | str) -> KeptTensor:
        """The same weight on `device` (the meta device: shapes and dtypes only)."""
        return self.permute_rows(lambda a: a.to(device))   # permute_rows maps every tensor of the layout


def affine(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int) -> torch.Tensor:
    """code * scale (+ offset) per group, in float32 (a product and a sum, not a fused multiply-add)."""
    n, k = codes.shape
    w = codes.float().view(n, k // group, group) * scales.float()[..., None]
    if offsets is not None:
        w = w + offsets.float()[..., None]
    return w.view(n, k)


# ---- block decoders: blocks [B, type size] uint8 -> codes [B, block], scales [B, block / group], offsets -----
def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [B, 2] -> float32 [B, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Packed 4-bit codes: each run of `width` bytes holds `width` codes in its low nibbles, then
    the next `width` in its high nibbles. [B, n] -> [B, 2n] uint8."""
    runs = qs.reshape(qs.shape[0], -1, 1, width)
    return np.concatenate([runs & 15, runs >> 4], axis=2).reshape(qs.shape[0], -1)


def _bits(qh: np.ndarray, rows: int) -> np.ndarray:
    """Bit j of byte i of each of `rows` runs -> code j * len(run) + i: [B, n] -> [B, 8n] (0/1)."""
    b = qh.shape[0]
    runs = qh.reshape(b, rows, 1, -1) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    return (runs & 1).reshape(b, -1)


def _high_bit32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: a little-endian 32-bit mask, bit i the high bit of code i: [B, 4] -> [B, 32]."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q5_0(b):
    codes = _nibbles(b[:, 6:], 16) | (_high_bit32(b[:, 2:6]) << 4)
    return codes.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None


def _q5_1(b):
    codes = _nibbles(b[:, 8:], 16) | (_high_bit32(b[:, 4:8]) << 4)
    return codes.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b):
    """Q4_K / Q5_K: d, dmin and the 6-bit sub-block scales and mins -> (scale, offset) [B, 8]."""
    from gguf.quants import Q4_K
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _q5_k(b):
    codes = _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 1) << 4)
    return (codes.astype(np.int8), *_k_scales(b))


def _q6_k(b):
    blocks = b.shape[0]
    low = (b[:, :128].reshape(blocks, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (b[:, 128:192].reshape(blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low.reshape(blocks, -1) | (high.reshape(blocks, -1) << 4)).astype(np.int8) - np.int8(32)
    return codes, _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32), None


CENTERED_TYPES = {"Q4_0"}   # 4-bit types whose every low is -8 * scale (_q4_0)


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, d * np.float32(-8)


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q4_k(b):
    return (_nibbles(b[:, 16:], 32), *_k_scales(b))


# type -> (decoder, layout, group)
# Types whose scale (and min) per group is a float16 the file stores: kept in float16 (exact, half the
# bytes of a float32 scale); Q5_K's and Q6_K's are products of two stored values, kept in float32.
FLOAT16_SCALES = {"Q8_0", "Q5_0", "Q5_1"}
CODE_BITS = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}   # int8-group types with narrower codes (else 8)
DECODERS = {
    "Q8_0": (_q8_0, Int8Groups, 32),
    "Q5_0": (_q5_0, Int8Groups, 32),
    "Q5_1": (_q5_1, Int8Groups, 32),
    "Q5_K": (_q5_k, Int8Groups, 32),
    "Q6_K": (_q6_k, Int8Groups, 16),
    "Q4_0": (_q4_0, Int4Groups, 32),
    "Q4_1": (_q4_1, Int4Groups, 32),
    "Q4_K": (_q4_k, Int4Groups, 32),
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def decode(tensor) -> KeptTensor:
    """A 2-D `gguf.GGUFReader` tensor in its kept layout (see the module docstring)."""
    name = tensor.tensor_type.name
    n, k = (int(d) for d in reversed(tensor.shape.tolist()))
    if name in FLOAT_TYPES:
        return KeptTensor(name, _float(tensor, name, n, k))
    if name in DECODERS:
        return KeptTensor(name, _decode_blocks(tensor, name, n, k))
    return _requantized(tensor, name, n, k)


def _float(tensor, name: str, n: int, k: int) -> torch.Tensor:
    data = np.asarray(tensor.data)
    if name == "BF16":
        return torch.from_numpy(data.view(np.int16).reshape(n, k).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.reshape(n, k).copy())


def _decode_blocks(tensor, name: str, n: int, k: int) -> Int8Groups | Int4Groups:
    import gguf
    fn, layout, group = DECODERS[name]
    block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = np.asarray(tensor.data).reshape(-1, size)
    codes = np.empty((blocks.shape[0], block), np.uint8 if layout is Int4Groups else np.int8)
    scales = np.empty((blocks.shape[0], block // group), np.float32)
    offsets = np.empty_like(scales)
    has_offsets = True
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        part = slice(start, start + CHUNK_BLOCKS)
        c, s, o = fn(blocks[part])
        codes[part], scales[part] = c, s
        if o is None:
            has_offsets = False
        else:
            offsets[part] = o
    codes_t = torch.from_numpy(codes.reshape(n, k))
    scales_t, offsets_t = (torch.from_numpy(a.reshape(n, k // group)) for a in (scales, offsets))
    if layout is Int4Groups:
        return Int4Groups(codes_t, scales_t, offsets_t, centered=name in CENTERED_TYPES)
    if name in FLOAT16_SCALES:
        scales_t, offsets_t = scales_t.half(), offsets_t.half()
    return Int8Groups(codes_t, scales_t, offsets_t if has_offsets else None, group, CODE_BITS.get(name, 8))


def _requantized(tensor, name: str, n: int, k: int) -> KeptTensor:
    import gguf
    try:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r} uses quantization {name}, which the installed gguf "
                         f"package cannot dequantize: {exc}") from exc
    w = torch.from_numpy(np.ascontiguousarray(np.asarray(w, np.float32).reshape(n, k)))
    block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    bits = 8 * size / block
    if bits <= INT4_MAX_BITS:
        return KeptTensor(name, int4_groups(w), f"{name} ({bits:.2f} bits/weight) has no kernel: requantized "
                                                f"to int4 groups of {QK} (at most {INT4_MAX_BITS} bits/weight)")
    return KeptTensor(name, int8_groups(w), f"{name} ({bits:.2f} bits/weight) has no kernel: requantized to "
                                            f"int8 groups of {QK} (more than {INT4_MAX_BITS} bits/weight)")


def int4_groups(w: torch.Tensor) -> Int4Groups:
    """A float weight [N, K] in 4-bit groups of 32 (min/max per group, round to nearest)."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"int4 weights need in_features divisible by {QK} (got {k}); use weights='int8'")
    groups = w.float().view(n, k // QK, QK)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Groups(codes, scale, low)


def int8_groups(w: torch.Tensor, group: int = QK) -> Int8Groups:
    """A float weight [N, K] in symmetric int8 groups (absolute maximum per group / 127)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int8 groups of {group} need in_features divisible by {group} (got {k})")
    groups = w.float().view(n, k // group, group)
    scale = (groups.abs().amax(-1) / 127).clamp(min=1e-12)
    codes = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return Int8Groups(codes, scale, None, group)
