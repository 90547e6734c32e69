"""Building the C++ kernels: the system compiler, for this CPU, once per source.

`kvserve build-kernels` (run by `make install`) compiles every kernel into the installed package
(kvserve/_kernels); a kernel not found there compiles on first use into ~/.cache/kvserve/kernels
($XDG_CACHE_HOME/kvserve/kernels where that is set). $KVSERVE_KERNEL_CACHE names the one folder to
use instead of both. A library is named by a key of the source, the shared headers (kvserve/csrc),
the compiler, the flags and the CPU's feature flags, so a different CPU or compiler builds its own;
a build writes a temporary file and renames it, so processes building at the same time do not clash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger("kvserve")

CACHE_ENV = "KVSERVE_KERNEL_CACHE"
FLAGS_ENV = "KVSERVE_CPU_KERNEL_FLAGS"   # extra compiler flags, after -march=native
HEADERS = Path(__file__).with_name("csrc")   # shared headers (simd.h), on every kernel's include path
# -O3 for this CPU; the float flags let sums be reordered and fused (FMA), never change NaN/inf handling
OPT_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
             "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-fPIC", "-shared")


class BuildError(RuntimeError):
    """The kernel could not be built; the message says why (the compiler's last line)."""


INSTALLED = Path(__file__).with_name("_kernels")   # what `kvserve build-kernels` writes


def cache_dir() -> Path:
    """Where a kernel missing from the installed package is built on first use."""
    from kvserve.paths import default_cache_root
    return Path(os.environ.get(CACHE_ENV) or default_cache_root() / "kernels")


def search_dirs() -> list[Path]:
    """Folders a built kernel is looked up in, in order."""
    return [cache_dir()] if os.environ.get(CACHE_ENV) else [INSTALLED, cache_dir()]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def torch_op_flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags for a source that includes torch's headers and registers torch ops
    (loaded with `torch.ops.load_library`, so compiled graphs call them through the dispatcher);
    $KVSERVE_CPU_KERNEL_FLAGS adds compiler flags (e.g. `-mno-avx512f` for the AVX2 paths, `-mno-avx` for the portable ones)."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", f"-DKVSERVE_TORCH={torch.__version__}"]
    flags += [f"-I{p}" for p in include_paths()]
    flags += os.environ.get(FLAGS_ENV, "").split()
    libs = [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu"]
    return flags, libs


def load_ops(state: dict, source: Path, unavailable: str) -> bool:
    """Whether `source`'s torch ops are loaded: built (or found built) and loaded on the first call,
    the answer kept in `state`; where they cannot be, False and `unavailable` logged once, its %s
    the reason."""
    if "ok" not in state:
        try:
            import torch
            flags, libs = torch_op_flags()
            torch.ops.load_library(str(build(source, flags, libs)))
            state["ok"] = True
        except (OSError, RuntimeError) as exc:   # BuildError is a RuntimeError
            log.warning(unavailable, exc)
            state["ok"] = False
    return state["ok"]


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(source: Path, flags: tuple[str, ...] | list[str], libs: tuple[str, ...] | list[str] = (),
          into: Path | None = None) -> Path:
    """Compile `source` into a shared library (or find it built) and return its path; `into` builds
    in that folder (the installed one) instead of the first-use cache."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++ or set CXX)")
    args = [*OPT_FLAGS, f"-I{HEADERS}", *flags]
    headers = [h.read_text() for h in sorted(HEADERS.glob("*.h"))]
    text = "\0".join([source.read_text(), *headers, cxx, *args, *libs, cpu_flags()])
    name = f"{source.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    for folder in [into] if into is not None else search_dirs():
        if (folder / name).exists():
            return folder / name
    out = (into or cache_dir()) / name
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cxx, *args, str(source), "-o", tmp, *libs], capture_output=True, text=True)
        except OSError as exc:
            raise BuildError(f"C++ compiler {cxx} cannot run ({exc.strerror}): install g++ or set CXX") from exc
        if done.returncode:
            lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
            raise BuildError(f"{source.name} did not compile: {lines[0][:200]}")
        os.replace(tmp, out)
        log.info("start-up: kernels build %s %.2f s (cached in %s)", source.name, time.perf_counter() - t0, out.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# Modules whose SOURCE is a kernel `kvserve build-kernels` builds (every .cpp in the package)
KERNEL_MODULES = ("kvserve.model.cpu", "kvserve.attention.cpu", "kvserve.engine.cpu", "kvserve.model.native")


def build_installed(into: Path | None = None) -> list[Path]:
    """Build every kernel into the installed package (or `into`), the compilers running side by side."""
    import importlib
    from concurrent.futures import ThreadPoolExecutor

    sources = [importlib.import_module(name).SOURCE for name in KERNEL_MODULES]
    flags, libs = torch_op_flags()
    folder = into or INSTALLED
    with ThreadPoolExecutor(len(sources)) as pool:
        built = list(pool.map(lambda source: build(source, flags, libs, into=folder), sources))
    for source, library in zip(sources, built):   # the libraries of older sources or other flags
        for old in folder.glob(f"{source.stem}-*.so"):
            if old != library:
                old.unlink(missing_ok=True)
    return built
