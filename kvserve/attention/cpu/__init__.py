"""Decode attention over paged K/V on the CPU, as C++ torch ops built on first use (paged_decode.cpp).

The kernel reads each row's keys and values from the pools by block id, in place, and parallelizes
over (row, K/V head) pairs with OpenMP (torch's own runtime). It is compiled with the system C++
compiler for this CPU against torch's headers (kvserve/native.py: cached in
~/.cache/kvserve/kernels, keyed by the source, the flags and the CPU's feature flags) and loaded
with `torch.ops.load_library`: `kvserve_attn::paged_decode_into` for a step's decode rows, and
`kvserve_attn::decode_one` / `decode_batch`, which the captured decode graphs (one token; 2 to
STACK_ROWS rows) call once per layer to store the rows' K/V and attend (one dispatcher call, no
Python). `kernel()` is False when no compiler is
found or the build fails (the reason is logged once); callers then use the torch path
(attention/paged.py), which is also the reference the kernel is tested against.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve import native
from kvserve.native import CACHE_ENV  # noqa: F401  (tests point it at a fresh folder)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# (query dtype, pool dtype) pairs the kernel reads
CODES = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1, (torch.float32, torch.bfloat16): 2}

_state: dict = {}


def kernel() -> bool:
    """True once the kernel's ops are loaded (built on the first call); False where they cannot be
    built (logged once)."""
    return native.load_ops(_state, SOURCE, "CPU decode attention kernel unavailable (%s); decode attention "
                           "uses the torch path")


def supports(pool: torch.Tensor) -> bool:
    """True when the kernel reads pools like `pool` (CPU, float32 or bfloat16, contiguous)."""
    return pool.device.type == "cpu" and pool.dtype in DTYPES and pool.is_contiguous()


def reads(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """True when the kernel takes queries of q_dtype over pools of pool_dtype (float32 or bfloat16
    queries over pools of their own dtype; float32 queries over bfloat16 pools)."""
    return (q_dtype, pool_dtype) in CODES


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 starts: torch.Tensor, ends: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 split: bool = True) -> torch.Tensor:
    """Row i of q [B, Hq, D] attends over positions [starts[i], ends[i]) of its block table row
    table[i] (long) in the pools [num_blocks, block_size, Hkv, D]; -> [B, Hq, Dv] in q's dtype (into
    `out` when given, which must be contiguous). Pools are q's dtype, or bfloat16 under float32 q.
    `split` False keeps each row's positions in one part (the batch-invariant mode); True splits long
    rows over the threads into parts at fixed positions (a row's result still its own whatever the
    other rows)."""
    if not kernel():
        raise RuntimeError("the CPU decode attention kernel is not built here (see the warning above)")
    if out is None:
        out = q.new_empty((*q.shape[:2], v_pool.shape[-1]))
    torch.ops.kvserve_attn.paged_decode_into(q, k_pool, v_pool, table, starts, ends, scale, out, split)
    return out


def paged_decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     slot: torch.Tensor, blocks: torch.Tensor, span: torch.Tensor, scale: float) -> torch.Tensor:
    """attention/paged.py paged_decode_one through the kernel: one op that stores the token's K/V
    and reads the pools in place (the kernel is loaded: `kernel()` was true when the step chose it)."""
    return torch.ops.kvserve_attn.decode_one(q, k, v, k_pool, v_pool, slot, blocks, span, scale)


def paged_decode_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       slots: torch.Tensor, tables: torch.Tensor, ranges: torch.Tensor, scale: float) -> torch.Tensor:
    """R decode rows in one op: row i's K/V [R, Hkv, D] stored at slots[i], then row i of q [R, Hq, D]
    attends over positions [ranges[0, i], ranges[1, i]) of its block table tables[i] ([R, W]), as
    `paged_decode` would after the backend's write; -> [R, Hq, Dv]."""
    return torch.ops.kvserve_attn.decode_batch(q, k, v, k_pool, v_pool, slots, tables, ranges, scale)
