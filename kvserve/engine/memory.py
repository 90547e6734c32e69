"""How much memory the KV pool may take: budget, weights, measured activation peak."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.kv.sizing import num_blocks_for_budget

log = logging.getLogger("kvserve")


@dataclass
class PoolPlan:
    """The decided pool size and how it was derived."""

    num_blocks: int
    block_size: int
    bytes_per_token: int   # bytes of one token slot of one block (one KV group's layers)
    budget_bytes: int
    source: str

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the pool tensors take."""
        return self.num_tokens * self.bytes_per_token


def device_memory(device: torch.device) -> int:
    """Total memory of a CUDA device, or available RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set kv_cache_memory")


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (or high-water mark with field='VmHWM')."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measure_activation_peak(device: torch.device, run) -> int:
    """Bytes of extra memory a warm-up step needs beyond what is already held."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        return torch.cuda.max_memory_allocated(device) - before
    _reset_peak_rss()
    before = rss_bytes()
    run()
    return max(0, rss_bytes("VmHWM") - before)


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS, so an earlier peak of this process is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def gib(n: float) -> str:
    """Human-readable GiB."""
    return f"{n / (1 << 30):.2f} GiB"


def plan_pool(kv_cache_memory: int | None, utilization: float | None, device: torch.device,
              weight_bytes: int, activation_bytes: int, block_size: int, bytes_per_token: int) -> PoolPlan:
    """Decide the number of KV blocks from the configured budget."""
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, f"kv_cache_memory={gib(kv_cache_memory)}"
    elif utilization is not None or device.type == "cuda":
        u = 0.9 if utilization is None else utilization
        total = device_memory(device)
        held = weight_bytes + activation_bytes
        if device.type == "cpu":  # MemAvailable already excludes the weights we hold
            held = activation_bytes
        budget = int(total * u) - held
        source = (f"gpu_memory_utilization={u} of {gib(total)} minus weights {gib(weight_bytes)} "
                  f"and activation peak {gib(activation_bytes)}")
    else:
        from kvserve.config import CPU_DEFAULT_KV_CACHE_MEMORY
        budget, source = CPU_DEFAULT_KV_CACHE_MEMORY, f"CPU default {gib(CPU_DEFAULT_KV_CACHE_MEMORY)}"
    num_blocks = num_blocks_for_budget(max(0, budget), block_size, bytes_per_token)
    return PoolPlan(num_blocks, block_size, bytes_per_token, budget, source)


def check_fits(plan: PoolPlan, blocks_per_sequence: int, max_model_len: int, bound: str = "") -> None:
    """Refuse a pool that cannot hold one max_model_len sequence (or, under a kv_policy that bounds
    the cache, what the policy keeps of one: `bound` says what)."""
    if plan.num_blocks < blocks_per_sequence:
        need_bytes = blocks_per_sequence * plan.block_size * plan.bytes_per_token
        what = f"one sequence under {bound}" if bound else f"one sequence of max_model_len={max_model_len}"
        fix = "lower the policy's window" if bound else "lower max_model_len"
        raise ValueError(
            f"KV cache too small: {plan.num_blocks} blocks x {plan.block_size} tokens "
            f"({gib(plan.nbytes)} from {plan.source}) cannot hold {what} ({blocks_per_sequence} blocks, "
            f"{gib(need_bytes)}). Raise kv_cache_memory / gpu_memory_utilization or {fix}.")
