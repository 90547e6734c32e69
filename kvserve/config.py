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
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")

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
