"""EngineConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

KV_CACHE_MODES = ("paged", "contiguous", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30  # like vLLM's CPU backend: a fixed KV space unless told
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | float | str) -> int:
    """Parse 1073741824, '1GiB', '512 MiB' or '2GB' into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {value!r}; use e.g. 1073741824, '2GiB' or '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_tier_spec(text: str):
    """'cpu:4GiB', 'disk:/path:20GiB' or 'redis://host:port/db' -> kvserve.kv.tiers.TierSpec."""
    from kvserve.kv.tiers import TierSpec
    usage = "use 'cpu:SIZE', 'disk:/path:SIZE' or 'redis://host:port/db', e.g. 'cpu:4GiB'"
    if not isinstance(text, str) or not text:
        raise ValueError(f"bad KV tier {text!r}: {usage}")
    if text.startswith(("redis://", "rediss://", "unix://")):
        return TierSpec("redis", location=text)
    kind, _, rest = text.partition(":")
    if kind == "disk":
        path, _, size = rest.rpartition(":")
        spec = TierSpec("disk", _tier_size(size, text, usage), path)
        if not path:
            raise ValueError(f"bad KV tier {text!r}: the disk tier needs a directory; {usage}")
        return spec
    if kind == "cpu":
        return TierSpec("cpu", _tier_size(rest, text, usage))
    raise ValueError(f"bad KV tier {text!r}: {usage}")


def _tier_size(size: str, text: str, usage: str) -> int:
    try:
        n = parse_bytes(size)
    except ValueError:
        raise ValueError(f"bad KV tier {text!r}: cannot read a size from {size!r}; {usage}") from None
    if n <= 0:
        raise ValueError(f"bad KV tier {text!r}: the size must be > 0; {usage}")
    return n


@dataclass
class EngineConfig:
    """Engine settings; `validate()` checks each field and names the bad one."""

    model: str | None = None
    dtype: str = "auto"                    # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                   # auto = cuda if available else cpu
    max_model_len: int | None = None       # None = the model's context length
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    seed: int | None = 0
    kv_cache_mode: str = "paged"           # paged | contiguous (reserve max_model_len per sequence) | none
    # KV cache storage format (kvserve/kv/formats.py; docs/QUANTIZATION.md)
    kv_cache_dtype: str = "auto"           # auto | float16 | bfloat16 | float32 | fp8_e4m3 | fp8_e5m2 | int8 | kivi4 | kivi2
    kv_cache_dtype_k: str | None = None    # keys in another format than kv_cache_dtype
    kv_cache_dtype_v: str | None = None    # values in another format than kv_cache_dtype
    kv_cache_dtype_skip_layers: tuple[int, ...] | list[int] = ()  # layers kept in full precision
    kv_cache_rotation: bool = False        # Hadamard rotation of q/k/v before quantization
    kv_cache_head_precision: float | None = None  # share of KV heads (most sensitive first) in ..._dtype
    kv_cache_head_precision_dtype: str = "int8"
    swap_space: float = 0.0                # GiB of host memory for swapped-out requests (0 = no swap)
    preemption_mode: str = "auto"          # recompute | swap | auto (cheaper of the two; needs swap_space)
    kv_tiers: list[str] | None = None      # prefix store below the device: "cpu:4GiB", "disk:/path:20GiB", "redis://h:p/db"
    kv_policy: str | None = None           # KV eviction (kv/policies.py, docs/EVICTION.md): sinks:4,1020, h2o:64,64, ...

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache_mode must be one of {KV_CACHE_MODES}, got {self.kv_cache_mode!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        self._validate_kv_format()
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        self._validate_offload()
        self._validate_kv_policy()

    def _validate_kv_policy(self) -> None:
        if self.kv_policy is None:
            return
        from kvserve.kv.policies import parse_policy
        parse_policy(self.kv_policy)
        if self.kv_cache_mode != "paged":
            raise ValueError(f"kv_policy needs kv_cache_mode='paged' (per-layer block tables), got {self.kv_cache_mode!r}")

    def _validate_offload(self) -> None:
        from kvserve.engine.scheduler import PREEMPTION_MODES
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
        specs = self.tier_specs()
        kinds = [s.kind for s in specs]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"kv_tiers may name each kind (cpu, disk, redis) once, got {self.kv_tiers}")
        if specs and (self.kv_cache_mode != "paged" or not self.enable_prefix_caching):
            raise ValueError("kv_tiers extend the prefix cache: they need kv_cache_mode='paged' and prefix caching on")

    def tier_specs(self) -> list:
        """kv_tiers parsed into kvserve.kv.tiers.TierSpec (ValueError naming a bad entry)."""
        if isinstance(self.kv_tiers, str):
            self.kv_tiers = [self.kv_tiers]
        return [parse_tier_spec(t) for t in self.kv_tiers or []]

    def _validate_kv_format(self) -> None:
        from kvserve.kv.formats import KIVI_BITS, KIVI_GROUP, canonical_kv_dtype, is_quantized
        self.kv_cache_dtype = canonical_kv_dtype(self.kv_cache_dtype)
        names = [self.kv_cache_dtype]
        for field_name in ("kv_cache_dtype_k", "kv_cache_dtype_v"):
            value = getattr(self, field_name)
            if value is not None:
                setattr(self, field_name, canonical_kv_dtype(value))
                names.append(getattr(self, field_name))
        self.kv_cache_head_precision_dtype = canonical_kv_dtype(self.kv_cache_head_precision_dtype)
        if isinstance(self.kv_cache_dtype_skip_layers, str):
            self.kv_cache_dtype_skip_layers = [int(x) for x in self.kv_cache_dtype_skip_layers.split(",") if x.strip()]
        self.kv_cache_dtype_skip_layers = tuple(int(x) for x in self.kv_cache_dtype_skip_layers)
        h = self.kv_cache_head_precision
        if h is not None and not 0 < h <= 1:
            raise ValueError(f"kv_cache_head_precision is the share of KV heads kept in "
                             f"kv_cache_head_precision_dtype: give a number in (0, 1], got {h}")
        if h is not None and not any(is_quantized(n) for n in names):
            raise ValueError("kv_cache_head_precision needs a quantized kv_cache_dtype (fp8, int8, kivi4, kivi2)")
        if self.kv_cache_rotation and not any(is_quantized(n) for n in names):
            raise ValueError("kv_cache_rotation only helps a quantized kv_cache_dtype (fp8, int8, kivi4, kivi2)")
        kivi = [n for n in names if n in KIVI_BITS]
        if kivi and self.kv_cache_mode == "contiguous":
            raise ValueError(f"{kivi[0]} keeps each still-filling block in full precision: with "
                             "kv_cache_mode='contiguous' that is the whole sequence; use kv_cache_mode='paged'")
        if kivi and self.kv_cache_mode == "paged" and self.block_size % KIVI_GROUP:
            raise ValueError(f"{kivi[0]} quantizes keys per channel over groups of {KIVI_GROUP} tokens inside a "
                             f"block: block_size must be a multiple of {KIVI_GROUP} (got {self.block_size}); "
                             f"pass block_size={KIVI_GROUP}")

    def torch_device(self) -> torch.device:
        """The device to run on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The weight and activation dtype."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]
