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
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvserve")

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
CACHE_ENV = "KVSERVE_KERNEL_CACHE"

_state: dict = {}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvserve" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _build(cxx: str) -> Path:
    """Compile the kernel (or find it built), atomically: parallel builders do not clash."""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"paged_decode-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    lib = ctypes.CDLL(str(_build(cxx)))
    fn = lib.kvserve_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return fn


def kernel():
    """The compiled kernel's entry point, or None where it cannot be built (logged once)."""
    if "fn" not in _state:
        try:
            _state["fn"] = _load()
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning("CPU decode attention kernel unavailable (%s); decode attention uses the torch path",
                        detail.strip().splitlines()[-1][:200] if detail.strip() else type(exc).__name__)
            _state["fn"] = None
    return _state["fn"]


def supports(pool: torch.Tensor) -> bool:
    """True when the kernel reads pools like `pool` (CPU, float32 or bfloat16, contiguous)."""
    return pool.device.type == "cpu" and pool.dtype in DTYPES and pool.is_contiguous()


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 starts: torch.Tensor, ends: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row i of q [B, Hq, D] attends over positions [starts[i], ends[i]) of its block table row
    table[i] (long) in the pools [num_blocks, block_size, Hkv, D]; -> [B, Hq, Dv] (into `out` when
    given, which must be contiguous)."""
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
            table.stride(0), scale, DTYPES[q.dtype], torch.get_num_threads())
    if rc:
        raise ValueError(f"CPU decode attention kernel: unsupported dtype {q.dtype}")
    return out
