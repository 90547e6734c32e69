"""KV cache storage formats: native floats, FP8, INT8, KIVI 4/2-bit, optional Hadamard rotation.

A *codec* turns per-token K or V entries [T, *shape] (shape = (kv_heads, head_dim), or (latent,)
for MLA) into the tensors the pool keeps and back. Every tensor a codec keeps is per block:
shape [num_blocks, ...] indexed by block id on dim 0, so copying, swapping or exporting a block
is the same loop over `KVStorage.slots[j]` for every format.

- `auto` / `float32` / `bfloat16` / `float16`: the entries as they are (auto = the model dtype).
- `fp8_e4m3`, `fp8_e5m2`: torch float8 payload (kept as its raw uint8 bytes, since CPU torch
  cannot index_copy_ float8) with one float16 scale per (token, KV head) = absmax / max finite
  float8 value, computed from the data: never a default 1.0.
- `int8`: symmetric, one float16 scale per (token, KV head) = absmax / 127.
- `kivi4`, `kivi2` (KIVI, Liu et al. 2024): asymmetric min/max quantization with an fp16 scale and
  an fp16 zero point (the group minimum) per group; keys per channel over groups of G = 32 tokens,
  values per token over groups of G channels (G = 32, or the whole vector when head_dim is not a
  multiple of 32); codes packed 2 (4-bit) or 4 (2-bit) to a uint8.

How KIVI meets paging. Keys are quantized per channel over 32 tokens, so a key group cannot be
quantized before its 32nd token exists. The pool's block size must be a multiple of 32; a block
is quantized (keys and values, all at once, from full-precision data) when its last slot is
written, and never again. A block written whole by one prefill chunk is quantized at once. Until
then the still-filling block lives in a full-precision *residual row*:
`KVStorage.residual[j][e]` is [rows, block_size, *shape] in the model dtype, and
`row_of_block[b]` names the row of block b (-1: none, the block's packed data is what counts).
Rows are a small fixed pool, not one per block: a residual per block would cost more than float16
itself and undo the point of the format. `split_budget` gives them at most RESIDUAL_SHARE of the
budget (at least two per KV group, so one sequence always runs; at most `max_num_seqs x groups`);
their bytes are counted in the budget and in `KVStorage.nbytes`. A row is taken when a block starts
filling and given back once it is quantized, so rows bound how many blocks may fill at once: the
KVCacheManager counts the rows each request's step needs and refuses an allocation that would
need more than there are, and the scheduler then preempts or waits as it does for blocks.

What a query sees (the paged form of KIVI's residual window): the earlier tokens of its own block
exact, every earlier block quantized. That depends on positions only, not on how the work was cut
into steps, so chunked prefill, prefix hits (full blocks, always quantized), recompute after
preemption and forks all give the same result as one uninterrupted run. Decode rows read their
own block from its residual row (a block that fills in this step keeps its row until the next
layer writes); prefill chunks attend over the stored keys plus an exact copy of the positions from
their first block's start (`attention/backends.py`, `_own_block_context`).

So for KIVI formats, full blocks (the only ones prefix caching or a tier ever keeps) are entirely
in `slots`; a still-filling block also has a residual row: `copy_blocks` carries it for
copy-on-write, and anything else that moves a still-filling block between pools must carry
`export_residual`/`import_residual` along (a write into a still-filling block without its row is
refused with an error rather than served wrong).

Rotation (`kv_cache_rotation`): an orthonormal Hadamard matrix H (head_dim a power of two).
Attention multiplies q, k and v by H before the cache sees them and the output by H^T after:
q H (k H)^T = q k^T, and P (v H) H^T = P v, so only the quantization error changes (outliers in
a few channels are spread over all of them).

Options that shape the plan (`build_kv_format`): separate K and V formats, layers kept in full
precision (`skip_layers`; a pool slot is shared by one layer of each KV group, so a skipped layer
keeps its whole slot in full precision), and per-KV-head precision (chosen heads in a higher
precision format, the rest in the aggressive one).
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field

import torch

from kvserve.kv.sizing import KIVI_GROUP, KV_FORMATS, suggest
from kvserve.kv.spec import KVGroup

FULL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KIVI_BITS = {name: int(KV_FORMATS[name].bits) for name in ("kivi4", "kivi2")}   # sizing's table holds the facts
KV_CACHE_DTYPES = ("auto", *FULL_DTYPES, *FP8_DTYPES, "int8", *KIVI_BITS)
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
                          "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                          "float": "float32"}
# int8 and fp8 keep one float16 scale per (token, KV head): 2 bytes instead of 4 per vector (int8
# then holds 1.94x the tokens of bfloat16 at head_dim 64, not 1.88x). float16's 11-bit mantissa adds
# under 0.05% to a scale whose codes already round at 1/254; the floor keeps it a normal float16.
SCALE_DTYPE = torch.float16
SCALE_FLOOR = torch.finfo(torch.float16).tiny


def _vector_scale(xf: torch.Tensor, qmax: float) -> torch.Tensor:
    """absmax / qmax per vector, rounded to the stored float16 (quantize with the scale decode sees)."""
    return (xf.abs().amax(-1, keepdim=True) / qmax).clamp(SCALE_FLOOR, torch.finfo(torch.float16).max).to(SCALE_DTYPE)
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block unless given (KIVI formats: KIVI_GROUP)
RESIDUAL_SHARE = 0.05    # most of a KIVI pool's budget its full-precision residual rows may take


def canonical_kv_dtype(name: str) -> str:
    """'FP8' -> 'fp8_e4m3' and friends; ValueError with suggestions for an unknown name."""
    key = str(name).strip().lower()
    key = KV_CACHE_DTYPE_ALIASES.get(key, key)
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}." + suggest(str(name), KV_CACHE_DTYPES))
    return key


def is_quantized(name: str) -> bool:
    """True for formats that store fewer bits than a 16-bit float (fp8, int8, kivi)."""
    return canonical_kv_dtype(name) not in ("auto", *FULL_DTYPES)


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Hadamard matrix [n, n] (Sylvester construction; n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"kv_cache_rotation needs head_dim to be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def zeroed(specs: list[tuple[tuple[int, ...], torch.dtype]], device) -> list[torch.Tensor]:
    """Zero-filled tensors, one per (shape, dtype). On the CPU they share one private anonymous
    mapping: the kernel hands out a page (zeroed) on its first write, so a pool costs memory for the
    blocks written, not for its budget. Elsewhere they are torch.zeros."""
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for n in sizes:   # each tensor starts on its own page
        starts.append(starts[-1] + -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
    buf = mmap.mmap(-1, max(starts[-1], mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return [torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=at).view(dtype).view(shape) if n
            else torch.zeros(shape, dtype=dtype) for (shape, dtype), n, at in zip(specs, sizes, starts)]


# --- codecs -------------------------------------------------------------------------------------


class Codec:
    """Stores entries of one shape; `residual` codecs encode whole blocks (see module docstring)."""

    name = "codec"
    residual = False

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape = tuple(shape)   # per-token entry shape: (heads, head_dim) or (latent,)
        self.dtype = dtype          # what decode returns (the model dtype)

    def tensor_specs(self, block_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape after the block dim, dtype) of each tensor kept per block."""
        raise NotImplementedError

    def allocate(self, num_blocks: int, block_size: int, device) -> list[torch.Tensor]:
        """Zeroed tensors [num_blocks, ...] (zeros decode to finite values)."""
        return zeroed([((num_blocks, *s), d) for s, d in self.tensor_specs(block_size)], device)

    def bytes_per_token(self, block_size: int) -> float:
        """Bytes per stored token, metadata included."""
        total = sum(math.prod(s) * torch.tensor([], dtype=d).element_size() for s, d in self.tensor_specs(block_size))
        return total / block_size

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per-token codecs: [T, *shape] -> one tensor [T, ...] per kept tensor."""
        raise NotImplementedError

    def encode_blocks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Residual codecs: whole blocks [nb, block_size, *shape] -> one tensor [nb, ...] each."""
        raise NotImplementedError

    def decode(self, tensors: list[torch.Tensor], idx: torch.Tensor, block_size: int) -> torch.Tensor:
        """Entries at flat slot indices of any shape -> [*idx.shape, *shape] in self.dtype."""
        raise NotImplementedError


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, ...] -> [num_blocks * block_size, ...] (a view)."""
    return t.view(-1, *t.shape[2:])


class NativeCodec(Codec):
    """Entries as floats of `store` dtype."""

    def __init__(self, shape, dtype, store: torch.dtype):
        super().__init__(shape, dtype)
        self.store = store
        self.name = {v: k for k, v in FULL_DTYPES.items()}.get(store, str(store))

    def tensor_specs(self, block_size):
        return [((block_size, *self.shape), self.store)]

    def encode(self, x):
        return [x.to(self.store)]

    def decode(self, tensors, idx, block_size):
        return _flat(tensors[0])[idx].to(self.dtype)


class Int8Codec(Codec):
    """Symmetric int8 with one float16 scale per vector (per token, per KV head)."""

    name = "int8"
    qmax = 127.0

    def tensor_specs(self, block_size):
        return [((block_size, *self.shape), torch.int8), ((block_size, *self.shape[:-1], 1), SCALE_DTYPE)]

    def encode(self, x):
        xf = x.float()
        scale = _vector_scale(xf, self.qmax)
        q = torch.round(xf / scale.float()).clamp(-self.qmax, self.qmax).to(torch.int8)
        return [q, scale]

    def decode(self, tensors, idx, block_size):
        q, scale = (_flat(t)[idx] for t in tensors)
        return (q.float() * scale.float()).to(self.dtype)


class Fp8Codec(Codec):
    """float8 (e4m3 or e5m2) with one float16 scale per vector from the data (absmax / fp8 max)."""

    def __init__(self, shape, dtype, fp8: torch.dtype, name: str):
        super().__init__(shape, dtype)
        self.fp8, self.name = fp8, name
        self.fmax = torch.finfo(fp8).max

    def tensor_specs(self, block_size):
        # the payload is kept as raw bytes: CPU torch has no index_copy_ for float8 tensors
        return [((block_size, *self.shape), torch.uint8), ((block_size, *self.shape[:-1], 1), SCALE_DTYPE)]

    def encode(self, x):
        xf = x.float()
        scale = _vector_scale(xf, self.fmax)
        q = (xf / scale.float()).clamp(-self.fmax, self.fmax).to(self.fp8)
        return [q.view(torch.uint8), scale]

    def decode(self, tensors, idx, block_size):
        q, scale = (_flat(t)[idx] for t in tensors)
        return (q.view(self.fp8).float() * scale.float()).to(self.dtype)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2**bits) -> [..., D * bits / 8], the first code in the low bits."""
    per = 8 // bits
    q = q.view(*q.shape[:-1], q.shape[-1] // per, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: [..., D * bits / 8] -> uint8 codes [..., D]."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(*p.shape[:-1], p.shape[-1] * per)


def _minmax_quant(x: torch.Tensor, dim: int, bits: int):
    """Asymmetric quantization of x (float32) over `dim`: (codes uint8, fp16 scale, fp16 zero)."""
    levels = (1 << bits) - 1
    mn = x.amin(dim, keepdim=True)
    mx = x.amax(dim, keepdim=True)
    scale = ((mx - mn) / levels).clamp(min=1e-6).half()  # fp16 smallest normal is ~6e-5; 1e-6 is subnormal but > 0
    zero = mn.half()
    q = torch.round((x - zero.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return q, scale, zero


class KiviKeyCodec(Codec):
    """KIVI keys: per channel over groups of G tokens inside a block; whole blocks at a time."""

    residual = True

    def __init__(self, shape, dtype, bits: int, group: int = KIVI_GROUP):
        super().__init__(shape, dtype)
        self.bits, self.group, self.name = bits, group, f"kivi{bits}"
        if shape[-1] * bits % 8:
            raise ValueError(f"kivi{bits} needs the vector width {shape[-1]} to fill whole bytes")

    def tensor_specs(self, block_size):
        if block_size % self.group:
            raise ValueError(f"{self.name} quantizes keys over groups of {self.group} tokens inside a block: "
                             f"block_size must be a multiple of {self.group}, got {block_size}")
        groups = block_size // self.group
        d = self.shape[-1]
        return [((block_size, *self.shape[:-1], d * self.bits // 8), torch.uint8),
                ((groups, *self.shape), torch.float16), ((groups, *self.shape), torch.float16)]

    def encode_blocks(self, x):
        nb, bs = x.shape[:2]
        g = x.float().view(nb, bs // self.group, self.group, *self.shape)
        q, scale, zero = _minmax_quant(g, 2, self.bits)
        return [pack_bits(q.view(nb, bs, *self.shape), self.bits), scale.squeeze(2), zero.squeeze(2)]

    def decode(self, tensors, idx, block_size):
        packed, scale, zero = tensors
        q = unpack_bits(_flat(packed)[idx], self.bits).float()
        gidx = idx // self.group  # flat slot b * bs + o -> flat group b * (bs / G) + o // G
        return (q * _flat(scale)[gidx].float() + _flat(zero)[gidx].float()).to(self.dtype)


class KiviValueCodec(Codec):
    """KIVI values: per token over groups of G channels; whole blocks at a time (see docstring)."""

    residual = True

    def __init__(self, shape, dtype, bits: int, group: int = KIVI_GROUP):
        super().__init__(shape, dtype)
        d = shape[-1]
        self.bits, self.name = bits, f"kivi{bits}"
        self.group = group if d % group == 0 else d  # one group per vector when head_dim says so
        if d * bits % 8:
            raise ValueError(f"kivi{bits} needs the vector width {d} to fill whole bytes")

    def tensor_specs(self, block_size):
        d = self.shape[-1]
        meta = (block_size, *self.shape[:-1], d // self.group)
        return [((block_size, *self.shape[:-1], d * self.bits // 8), torch.uint8),
                (meta, torch.float16), (meta, torch.float16)]

    def encode_blocks(self, x):
        d = self.shape[-1]
        g = x.float().view(*x.shape[:-1], d // self.group, self.group)
        q, scale, zero = _minmax_quant(g, -1, self.bits)
        return [pack_bits(q.view(x.shape), self.bits), scale.squeeze(-1), zero.squeeze(-1)]

    def decode(self, tensors, idx, block_size):
        packed, scale, zero = (_flat(t)[idx] for t in tensors)
        q = unpack_bits(packed, self.bits).float()
        q = q.view(*q.shape[:-1], -1, self.group)
        out = q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
        return out.flatten(-2).to(self.dtype)


def make_codec(name: str, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> Codec:
    """The codec for format `name` storing role 'k' or 'v' entries of `shape`; decodes to `dtype`."""
    name = canonical_kv_dtype(name)
    if name == "auto":
        return NativeCodec(shape, dtype, dtype)
    if name in FULL_DTYPES:
        return NativeCodec(shape, dtype, FULL_DTYPES[name])
    if name in FP8_DTYPES:
        return Fp8Codec(shape, dtype, FP8_DTYPES[name], name)
    if name == "int8":
        return Int8Codec(shape, dtype)
    cls = KiviKeyCodec if role == "k" else KiviValueCodec
    return cls(shape, dtype, KIVI_BITS[name])


# --- the plan for a whole pool ------------------------------------------------------------------


@dataclass
class Part:
    """Heads of one entry kept by one codec (heads None: the whole entry)."""

    heads: list[int] | None
    codec: Codec


@dataclass
class EntryFormat:
    """How one entry (K, V or the MLA latent) of a slot is kept: one or more head parts."""

    shape: tuple[int, ...]
    parts: list[Part]

    @property
    def residual(self) -> bool:
        """True when some part waits for whole blocks (the entry then has a residual row)."""
        return any(p.codec.residual for p in self.parts)

    @property
    def name(self) -> str:
        """Codec names of the parts, e.g. 'int8' or 'kivi2+int8[h1]'."""
        if len(self.parts) == 1:
            return self.parts[0].codec.name
        return "+".join(f"{p.codec.name}[h{','.join(map(str, p.heads))}]" for p in self.parts)


@dataclass
class SlotFormat:
    """Formats of one pool slot (one layer of each KV group) and its rotation, if any."""

    entries: list[EntryFormat]
    rotation: torch.Tensor | None = None


@dataclass
class KVCacheFormat:
    """Everything the pool needs to know about how it stores K/V: one SlotFormat per slot."""

    slots: list[SlotFormat]
    layer_slot: dict[int, int]
    dtype: torch.dtype
    block_size: int
    description: str = "auto"
    notes: list[str] = field(default_factory=list)

    def slot_bytes_per_token(self, j: int) -> float:
        """Bytes one token takes in slot j (one layer), scales and zero points included."""
        return sum(p.codec.bytes_per_token(self.block_size) for e in self.slots[j].entries for p in e.parts)

    @property
    def page_bytes_per_token(self) -> int:
        """Bytes one token slot of one block takes over all slots: what sizes the pool."""
        total = sum(self.slot_bytes_per_token(j) for j in range(len(self.slots)))
        return math.ceil(total - 1e-9)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers of the model (hybrid models: every group)."""
        return math.ceil(sum(self.slot_bytes_per_token(j) for j in self.layer_slot.values()) - 1e-9)

    @property
    def residual_bytes_per_token(self) -> int:
        """Bytes one token of a residual row takes over all slots (0: the format has no residual)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(math.prod(e.shape) * elem for s in self.slots for e in s.entries if e.residual)

    @property
    def has_residual(self) -> bool:
        """True when some slot keeps still-filling blocks in residual rows (KIVI)."""
        return self.residual_bytes_per_token > 0

    def to(self, device) -> KVCacheFormat:
        """Move the rotation matrices to `device` (in place); returns self."""
        for s in self.slots:
            if s.rotation is not None:
                s.rotation = s.rotation.to(device)
        return self


@dataclass(frozen=True)
class FormatOptions:
    """The KV format options of an engine, checked and normalised (canonical names, the block size)."""

    kv_cache_dtype: str
    kv_cache_dtype_k: str | None
    kv_cache_dtype_v: str | None
    kv_cache_dtype_skip_layers: tuple[int, ...]
    kv_cache_head_precision_dtype: str
    block_size: int


def format_options(kv_cache_dtype: str, kv_cache_dtype_k: str | None, kv_cache_dtype_v: str | None,
                   skip_layers, rotation: bool, head_precision: float | None, head_precision_dtype: str,
                   block_size: int | None, kv_cache_mode: str) -> FormatOptions:
    """Check the format options against each other and the cache mode (ValueError naming the bad one);
    `block_size` None picks the default (KIVI_GROUP for a KIVI format, else DEFAULT_BLOCK_SIZE)."""
    base = canonical_kv_dtype(kv_cache_dtype)
    k_name = canonical_kv_dtype(kv_cache_dtype_k) if kv_cache_dtype_k is not None else None
    v_name = canonical_kv_dtype(kv_cache_dtype_v) if kv_cache_dtype_v is not None else None
    names = [n for n in (base, k_name, v_name) if n is not None]
    high = canonical_kv_dtype(head_precision_dtype)
    if isinstance(skip_layers, str):
        skip_layers = [int(x) for x in skip_layers.split(",") if x.strip()]
    skip = tuple(int(x) for x in skip_layers)
    quantized = any(is_quantized(n) for n in names)
    if head_precision is not None and not quantized:
        raise ValueError("kv_cache_head_precision needs a quantized kv_cache_dtype (fp8, int8, kivi4, kivi2)")
    if rotation and not quantized:
        raise ValueError("kv_cache_rotation only helps a quantized kv_cache_dtype (fp8, int8, kivi4, kivi2)")
    kivi = [n for n in names if n in KIVI_BITS]
    block_size = _block_size(block_size, kivi)
    if kivi and kv_cache_mode == "contiguous":
        raise ValueError(f"{kivi[0]} keeps each still-filling block in full precision: with "
                         "kv_cache_mode='contiguous' that is the whole sequence; use kv_cache_mode='paged'")
    if kivi and kv_cache_mode == "paged" and block_size % KIVI_GROUP:
        raise ValueError(f"{kivi[0]} quantizes keys per channel over groups of {KIVI_GROUP} tokens inside a "
                         f"block: block_size must be a multiple of {KIVI_GROUP} (got {block_size}); "
                         f"pass block_size={KIVI_GROUP}")
    return FormatOptions(base, k_name, v_name, skip, high, block_size)


def _block_size(block_size: int | None, kivi: list[str]) -> int:
    """The block size given, or the default for the formats (logged when KIVI picks it)."""
    if block_size is not None:
        return block_size
    if not kivi:
        return DEFAULT_BLOCK_SIZE
    logging.getLogger("kvserve").info(
        "block_size %d chosen for %s (keys are quantized over groups of %d tokens inside a block)",
        KIVI_GROUP, kivi[0], KIVI_GROUP)
    return KIVI_GROUP


def build_kv_format(groups: list[KVGroup], dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto",
                    kv_cache_dtype_k: str | None = None, kv_cache_dtype_v: str | None = None,
                    skip_layers=(), rotation: bool = False, high_heads: dict[int, list[int]] | None = None,
                    high_dtype: str = "int8") -> KVCacheFormat:
    """Resolve the format options into a KVCacheFormat for the pool of `groups`.

    `high_heads` maps a slot to the KV heads kept in `high_dtype` (per-head precision); the other
    heads of that slot use the K/V formats. Raises ValueError for combinations that cannot work.
    """
    base = canonical_kv_dtype(kv_cache_dtype)
    k_name = canonical_kv_dtype(kv_cache_dtype_k or base)
    v_name = canonical_kv_dtype(kv_cache_dtype_v or base)
    high = canonical_kv_dtype(high_dtype)
    spec = groups[0].spec
    num_layers = sum(len(g.layers) for g in groups)
    skip = {int(i) for i in skip_layers}
    bad = sorted(i for i in skip if not 0 <= i < num_layers)
    if bad:
        raise ValueError(f"kv_cache_dtype_skip_layers {bad} are not layers of this model (0..{num_layers - 1})")
    layer_slot = {layer: j for g in groups for j, layer in enumerate(g.layers)}
    num_slots = len(groups[0].layers)
    slots, notes = [], []
    for j in range(num_slots):
        layers = [g.layers[j] for g in groups]
        skipped = [i for i in layers if i in skip]
        if skipped and len(skipped) < len(layers):
            notes.append(f"layers {layers} share pool slot {j}: all kept in full precision for skipped {skipped}")
        names = ("auto", "auto") if skipped else (k_name, v_name)
        slots.append(_slot_format(spec, dtype, names, rotation and not skipped,
                                  None if skipped else (high_heads or {}).get(j), high))
    fmt = KVCacheFormat(slots, layer_slot, dtype, block_size, notes=notes)
    fmt.description = describe(base, kv_cache_dtype_k, kv_cache_dtype_v, skip, rotation, high_heads, high, num_slots)
    fmt.page_bytes_per_token  # noqa: B018 - checks every codec against the block size (ValueError)
    return fmt


def _slot_format(spec, dtype, names, rotation, high_heads, high) -> SlotFormat:
    shapes = spec.entry_shapes
    if spec.latent:
        if names[0] != names[1]:
            raise ValueError("an MLA cache keeps one latent per token: give one kv_cache_dtype, not K and V formats")
        if names[0] in KIVI_BITS or rotation or high_heads:
            raise ValueError("MLA caches support native, fp8 and int8 formats only (no kivi, rotation or "
                             "per-head precision: the latent has no heads)")
        return SlotFormat([EntryFormat(shapes[0], [Part(None, make_codec(names[0], "k", shapes[0], dtype))])])
    entries = []
    for role, name, shape in zip("kv", names, shapes):
        heads = sorted(set(high_heads or [])) if is_quantized(name) else []
        rest = [h for h in range(shape[0]) if h not in heads]
        parts = [Part(None if not heads else rest, make_codec(name, role, (len(rest), *shape[1:]), dtype))] if rest else []
        if heads:
            parts.append(Part(heads, make_codec(high, role, (len(heads), *shape[1:]), dtype)))
        entries.append(EntryFormat(shape, parts))
    quantized = any(is_quantized(n) for n in names)
    rot = hadamard(shapes[0][-1], dtype) if rotation and quantized else None
    return SlotFormat(entries, rot)


def describe(base, k, v, skip, rotation, high_heads, high, num_slots) -> str:
    """One line naming the format: 'int8', 'K=int8 V=kivi2, rotation, skip layers [0]'..."""
    k, v = canonical_kv_dtype(k or base), canonical_kv_dtype(v or base)
    text = k if k == v else f"K={k} V={v}"
    extras = []
    if rotation:
        extras.append("Hadamard rotation")
    if skip:
        extras.append(f"layers {sorted(skip)} full precision")
    if high_heads:
        n = sum(len(h) for h in high_heads.values())
        extras.append(f"{n} (slot, KV head) pairs in {high}")
    return ", ".join([text, *extras])


def split_budget(budget: int, block_size: int, page_bytes_per_token: int, row_bytes_per_token: int,
                 max_rows: int, min_rows: int = 1) -> tuple[int, int]:
    """(num_blocks, residual rows) fitting `budget` bytes: blocks * bs * page + rows * bs * row.

    The rows take at most RESIDUAL_SHARE of the budget (never fewer than `min_rows`, never more
    than `max_rows` or the blocks left): the scheduler admits only as many still-filling blocks
    as there are rows (KVCacheManager.residual_rows), so the rest of the budget holds tokens.
    """
    block, row = block_size * page_bytes_per_token, block_size * row_bytes_per_token
    if row == 0:
        return max(0, budget // block), 0
    rows = max(min_rows, min(max_rows, int(budget * RESIDUAL_SHARE) // row))
    rows = min(rows, max(0, budget // (block + row)))
    return max(0, (budget - rows * row) // block), rows


# --- quality helpers (tests, calibration, evaluation) -------------------------------------------


def roundtrip(codec: Codec, x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Encode then decode x [T, *shape] as the pool would (T a multiple of block_size for KIVI)."""
    t = x.shape[0]
    nb = -(-t // block_size)
    tensors = codec.allocate(nb, block_size, x.device)
    idx = torch.arange(t, device=x.device)
    if codec.residual:
        if t % block_size:
            raise ValueError(f"{codec.name} encodes whole blocks: {t} tokens is not a multiple of {block_size}")
        encoded = codec.encode_blocks(x.view(nb, block_size, *x.shape[1:]))
        for dst, src in zip(tensors, encoded):
            dst.copy_(src)
    else:
        for dst, src in zip(tensors, codec.encode(x)):
            _flat(dst).index_copy_(0, idx, src)
    return codec.decode(tensors, idx, block_size)
