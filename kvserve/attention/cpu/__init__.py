"""Decode attention over paged K/V on the CPU, as a C++ kernel built on first use (paged_decode.cpp).

The kernel reads each row's keys and values from the pools by block id, in place, and parallelizes
over (row, K/V head) pairs with OpenMP (torch's own runtime, loaded first). It is compiled with the
system C++ compiler for this CPU (-O3 -march=native) into ~/.cache/kvserve/kernels, keyed by the
source, the flags and the CPU's feature flags, and loaded with ctypes. `kernel()` is None when no
compiler is found or the build fails (the reason is logged once); callers then use the torch path
(attention/paged.py), which is also the reference the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvserve import native
from kvserve.attention.paged import write_one
from kvserve.native import CACHE_ENV  # noqa: F401  (tests point it at a fresh folder)

log = logging.getLogger("kvserve")

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ("-std=c++17",)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# (query dtype, pool dtype) -> the kernel's dtype code
CODES = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1, (torch.float32, torch.bfloat16): 2}

_state: dict = {}


def _load():
    lib = ctypes.CDLL(str(native.build(SOURCE, FLAGS)))
    fn = lib.kvserve_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return fn


def kernel():
    """The compiled kernel's entry point, or None where it cannot be built (logged once)."""
    if "fn" not in _state:
        try:
            _state["fn"] = _load()
        except (OSError, native.BuildError) as exc:
            log.warning("CPU decode attention kernel unavailable (%s); decode attention uses the torch path", exc)
            _state["fn"] = None
    return _state["fn"]


def supports(pool: torch.Tensor) -> bool:
    """True when the kernel reads pools like `pool` (CPU, float32 or bfloat16, contiguous)."""
    return pool.device.type == "cpu" and pool.dtype in DTYPES and pool.is_contiguous()


def reads(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """True when the kernel takes queries of q_dtype over pools of pool_dtype (float32 or bfloat16
    queries over pools of their own dtype; float32 queries over bfloat16 pools)."""
    return (q_dtype, pool_dtype) in CODES


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 starts: torch.Tensor, ends: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row i of q [B, Hq, D] attends over positions [starts[i], ends[i]) of its block table row
    table[i] (long) in the pools [num_blocks, block_size, Hkv, D]; -> [B, Hq, Dv] in q's dtype (into
    `out` when given, which must be contiguous). Pools are q's dtype, or bfloat16 under float32 q."""
    fn = kernel()
    b, hq, d = q.shape
    _, bs, hkv, dv = v_pool.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = q.new_empty((b, hq, dv))
    for t in (table, starts, ends):
        if t.dtype != torch.long or t.stride(-1) != 1:
            raise ValueError("block tables and ranges must be long tensors with unit last stride")
    rc = fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(), starts.data_ptr(),
            ends.data_ptr(), out.data_ptr(), b, table.shape[1], hq, hkv, d, dv, bs, q.stride(0), q.stride(1),
            table.stride(0), scale, CODES.get((q.dtype, k_pool.dtype), -1), torch.get_num_threads())
    if rc:
        raise ValueError(f"CPU decode attention kernel: unsupported dtypes (queries {q.dtype}, pools {k_pool.dtype})")
    return out


@torch.library.custom_op("kvserve::paged_decode_blocks", mutates_args=())
def paged_decode_blocks(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                        span: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_decode of one row q [1, Hq, D] over positions [span[0], span[1]) of `blocks` [n], as
    an op the one-token graph calls without looking inside (no shape in it depends on n)."""
    return paged_decode(q, k_pool, v_pool, blocks[None], span[:1], span[1:], scale)


@paged_decode_blocks.register_fake
def _(q, k_pool, v_pool, blocks, span, scale):
    return q.new_empty((*q.shape[:2], v_pool.shape[-1]))


def paged_decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     slot: torch.Tensor, blocks: torch.Tensor, span: torch.Tensor, scale: float) -> torch.Tensor:
    """attention/paged.py paged_decode_one through the kernel: the write traced, the read in place."""
    write_one(k, v, k_pool, v_pool, slot)
    return paged_decode_blocks(q, k_pool, v_pool, blocks, span, scale)
