"""Few-row GEMVs for CPU decode steps (gemv.cpp), built on first use as torch ops.

`torch.ops.kvserve_cpu.int8_gemv` and `bf16_gemv` read int8 / bfloat16 weights at close to the
machine's memory bandwidth for one to a few rows (a decode step), where torch's own CPU paths
(`_weight_int8pack_mm`, oneDNN's bfloat16 GEMM) read about half as fast; `q8g_gemv` multiplies by
int8 codes with a float32 scale (and min) per group of 16 or 32 inputs, a GGUF block's own codes,
and `q4g_gemv` 4-bit codes in tiles of 16 output channels (`q4g_tile`; integer dot products with the rows quantized to
int16 per group, llama.cpp's Q8_1 with 16-bit codes). The source compiles
against torch's headers with the system compiler (kvserve/native.py: cached, keyed by source,
flags and CPU; $KVSERVE_CPU_KERNEL_FLAGS adds compiler flags, e.g. `-mno-avx512f` for the AVX2
path, `-mno-avx` for the portable one) and loads with `torch.ops.load_library`, so compiled graphs call the ops through
the dispatcher. `available()` is False where the build fails (logged once); the layers (model/quant.py) then keep
torch's kernels.
"""

from __future__ import annotations

from pathlib import Path

from kvserve import native

SOURCE = Path(__file__).with_name("gemv.cpp")
FLAGS_ENV = native.FLAGS_ENV
MAX_ROWS = 64     # the ops' own limit; callers pick smaller thresholds where they win

_state: dict = {}


def library() -> Path:
    """The ops' shared library for this CPU and flags (built on the first call; raises BuildError)."""
    flags, libs = native.torch_op_flags()
    return native.build(SOURCE, flags, libs)


def available() -> bool:
    """True once the ops are loaded (built on the first call; False, logged once, where they cannot be)."""
    return native.load_ops(_state, SOURCE, "CPU GEMV kernels unavailable (%s); one-row int8/bfloat16 layers "
                           "use torch's kernels")
