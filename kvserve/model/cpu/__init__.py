"""Few-row GEMVs for CPU decode steps (gemv.cpp), built on first use as torch ops.

`torch.ops.kvserve_cpu.int8_gemv` and `bf16_gemv` read int8 / bfloat16 weights at close to the
machine's memory bandwidth for one to a few rows (a decode step), where torch's own CPU paths
(`_weight_int8pack_mm`, oneDNN's bfloat16 GEMM) read about half as fast. The source compiles
against torch's headers with the system compiler (kvserve/native.py: cached, keyed by source,
flags and CPU) and loads with `torch.ops.load_library`, so compiled graphs call the ops through
the dispatcher. `available()` is False where the build fails (logged once); QuantLinear then keeps
torch's kernels.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvserve import native

log = logging.getLogger("kvserve")

SOURCE = Path(__file__).with_name("gemv.cpp")
MAX_ROWS = 64     # the ops' own limit; callers pick smaller thresholds where they win

_state: dict = {}


def _flags() -> tuple[list[str], list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", f"-DKVSERVE_TORCH={torch.__version__}"]
    flags += [f"-I{p}" for p in include_paths()]
    libs = [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu"]
    return flags, libs


def available() -> bool:
    """True once the ops are loaded (built on the first call; False, logged once, where they cannot be)."""
    if "ok" not in _state:
        try:
            flags, libs = _flags()
            torch.ops.load_library(str(native.build(SOURCE, flags, libs)))
            _state["ok"] = True
        except (OSError, RuntimeError) as exc:
            log.warning("CPU GEMV kernels unavailable (%s); one-row int8/bfloat16 layers use torch's kernels", exc)
            _state["ok"] = False
    return _state["ok"]
