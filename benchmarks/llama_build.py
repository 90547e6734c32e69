"""llama.cpp built for this CPU: the peer every benchmark measures kvserve against.

    python benchmarks/llama_build.py              # llama-server, llama-quantize, llama-bench, ... into the cache
    python benchmarks/llama_build.py --python     # llama-cpp-python into this interpreter's environment
    python benchmarks/llama_build.py --flags      # print the cmake options and stop

Both come from the llama.cpp tree vendored in the llama-cpp-python sdist (one version, so the
tools and the Python binding run the same code), configured with every vector extension this
CPU lists except AMX: some VMs list AMX without enabling its tile state, and a build that uses it
dies with an illegal instruction on its first batch. The tools go to
~/.cache/kvserve/llama-server/build-<version>-<hash of the options>/bin/ (10+ minutes on two
cores, `nice`d); llama-cpp-python is compiled by pip with the same options in CMAKE_ARGS and a
stamp next to the interpreter records them, so a benchmark can print what its peer was built with.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "llama-server"
# Tools built when the tree has them, in this order (llama-quantize first: it has the fewest
# sources of its own); llama-lookup and llama-speculative-simple are examples.
TOOLS = ("llama-quantize", "llama-server", "llama-bench", "llama-lookup", "llama-speculative-simple")
# Where `--python` records the CMAKE_ARGS llama-cpp-python was compiled with.
PYTHON_STAMP = Path(sys.prefix) / "llama-cpp-python.cmake-args"

# ggml's instruction-set switches, by the /proc/cpuinfo flag that each needs.
GGML_CPU_FLAGS = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma",
                  "GGML_F16C": "f16c", "GGML_BMI2": "bmi2", "GGML_AVX512": "avx512f",
                  "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
                  "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def run_step(cmd: list[str], cwd: Path | None = None, nice: bool = False, log: Path | None = None,
             env: dict | None = None) -> None:
    """Run a build step; with `log`, all its output goes there and only progress lines are shown."""
    if nice:
        cmd = ["nice", "-n", "19", *cmd]
    print("+ " + " ".join(cmd), flush=True)
    if log is None:
        subprocess.run(cmd, cwd=cwd, check=True, env=env)
        return
    with open(log, "a") as f, subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True, errors="replace", env=env) as proc:
        for line in proc.stdout:
            f.write(line)
            if line.lstrip().startswith("[") or " error" in line.lower():
                print("  " + line.strip()[:160], flush=True)
    if proc.returncode:
        tail = log.read_text().splitlines()[-40:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}); the end of {log}:\n" + "\n".join(tail))


def cpu_flags() -> set[str] | None:
    """The flags /proc/cpuinfo lists for this CPU, None where there is no /proc/cpuinfo."""
    try:
        return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return None


def cpu_options() -> list[str]:
    """ggml's instruction-set options: every extension this CPU lists, AMX always off."""
    flags = cpu_flags()
    if flags is None:
        return ["-DGGML_NATIVE=ON"]
    return (["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in GGML_CPU_FLAGS.items()]
            + [f"-D{opt}=OFF" for opt in AMX_OPTIONS])


def build_options() -> list[str]:
    """The cmake options shared by the tools and llama-cpp-python."""
    return ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", *cpu_options()]


def python_cmake_args() -> str:
    """CMAKE_ARGS for pip's build of llama-cpp-python (its multimodal library left out)."""
    return " ".join([*build_options(), "-DLLAVA_BUILD=OFF"])


def build_key() -> str:
    """Version plus a hash of the options: a build folder per configuration."""
    digest = hashlib.sha1(" ".join(build_options()).encode()).hexdigest()[:10]
    return f"{LLAMA_CPP_PYTHON_VERSION}-{digest}"


def build_dir(cache: Path = CACHE_DIR) -> Path:
    return cache / f"build-{build_key()}"


def sdist(cache: Path = CACHE_DIR) -> Path:
    """The llama-cpp-python sdist in `cache`, downloaded when missing."""
    path = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist", flush=True)
    # --no-binary for this package only: with :all:, pip would build its build backend's own
    # dependencies from source too, one after another.
    run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(cache)])
    if not path.exists():
        raise RuntimeError(f"pip download left no {path.name} in {cache}")
    return path


def llama_cpp_tree(cache: Path = CACHE_DIR) -> Path:
    """The llama.cpp source tree vendored in the sdist, extracted once."""
    tree = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        archive = sdist(cache)
        print(f"extracting {archive.name}", flush=True)
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    if not (tree / "CMakeLists.txt").exists():
        raise RuntimeError(f"no llama.cpp tree in {tree}")
    return tree


def tool_path(name: str, cache: Path = CACHE_DIR) -> Path:
    """Where the build puts tool `name` (it may not be built yet)."""
    return build_dir(cache) / "bin" / name


def configure(tree: Path, build: Path, log: Path, nice: bool) -> None:
    """cmake's configure step, once per build folder."""
    if (build / "CMakeCache.txt").exists():
        return
    options = [*build_options(), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_USE_PREBUILT_UI=OFF"]  # no web UI download: the benchmarks use the HTTP API
    if shutil.which("ninja"):
        options += ["-G", "Ninja"]
    print("configuring llama.cpp with cmake: " + " ".join(build_options()), flush=True)
    run_step(["cmake", "-S", str(tree), "-B", str(build), *options], nice=nice, log=log)


def known_targets(build: Path) -> set[str]:
    """The targets the configured build offers (`cmake --build --target help`)."""
    out = subprocess.run(["cmake", "--build", str(build), "--target", "help"], capture_output=True, text=True)
    lines = [line.strip().removeprefix("... ") for line in out.stdout.splitlines()]
    return {line.split(":")[0].split()[0] for line in lines if line}


def build_tools(tools: tuple[str, ...] = TOOLS, cache: Path = CACHE_DIR, jobs: int = 2,
                nice: bool = True) -> dict[str, Path]:
    """Each tool of `tools` that the tree has, built when missing: name -> binary."""
    found = {t: tool_path(t, cache) for t in tools if tool_path(t, cache).exists()}
    if len(found) == len(tools):
        return found
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake (e.g. `apt-get install -y cmake`)")
    tree, build = llama_cpp_tree(cache), build_dir(cache)
    log = cache / f"build-{build_key()}.log"
    print(f"(full build output in {log})", flush=True)
    configure(tree, build, log, nice)
    targets = known_targets(build) or set(tools)  # no listing: try them all
    wanted = [t for t in tools if t in targets and t not in found]
    missing = [t for t in tools if t not in targets]
    if missing:
        print(f"not in this llama.cpp tree: {', '.join(missing)}", flush=True)
    if wanted:
        print(f"building {', '.join(wanted)} with {jobs} jobs (10+ minutes on two cores)", flush=True)
    for target in wanted:  # one at a time, so the first is ready before the rest are built
        run_step(["cmake", "--build", str(build), "--target", target, "-j", str(jobs)], nice=nice, log=log)
        print(f"built {tool_path(target, cache)}", flush=True)
    built = {t: tool_path(t, cache) for t in tools if tool_path(t, cache).exists()}
    lost = [t for t in wanted if t not in built]
    if lost:
        raise RuntimeError(f"the build finished without {', '.join(lost)} in {build / 'bin'}")
    return built


def build_tool(name: str, cache: Path = CACHE_DIR) -> Path:
    """One tool's binary, built (alone) when missing."""
    path = build_tools((name,), cache=cache).get(name)
    if path is None:
        raise RuntimeError(f"this llama.cpp tree has no {name}")
    return path


def python_build_args() -> str | None:
    """The CMAKE_ARGS the installed llama-cpp-python was built with, None when not recorded."""
    try:
        return PYTHON_STAMP.read_text().strip() or None
    except OSError:
        return None


def installed_llama_cpp_python() -> str | None:
    """The installed llama-cpp-python's version, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def build_python(jobs: int = 2, force: bool = False) -> None:
    """pip-install llama-cpp-python from the sdist, compiled with python_cmake_args()."""
    args = python_cmake_args()
    if (not force and installed_llama_cpp_python() == LLAMA_CPP_PYTHON_VERSION
            and python_build_args() == args):
        print(f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} is installed with this CPU's options", flush=True)
        return
    env = {**os.environ, "CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    print(f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with CMAKE_ARGS={args!r} "
          "(several minutes on two cores)", flush=True)
    run_step([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir",
              str(sdist())], nice=True, env=env)
    install_runtime_requirements()
    PYTHON_STAMP.write_text(args + "\n")
    print(f"recorded the build options in {PYTHON_STAMP}", flush=True)


def install_runtime_requirements() -> None:
    """llama-cpp-python's own requirements (not its extras'), which --no-deps left out; pip keeps
    the ones already satisfied, so torch's numpy stays."""
    from importlib.metadata import requires
    reqs = [r for r in requires("llama-cpp-python") or [] if "extra ==" not in r]
    if reqs:
        run_step([sys.executable, "-m", "pip", "install", "-q", *reqs])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", action="store_true", help="build llama-cpp-python into this environment")
    p.add_argument("--force", action="store_true", help="with --python: rebuild even when installed")
    p.add_argument("--flags", action="store_true", help="print the cmake options and stop")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if args.flags:
        print(" ".join(build_options()))
        return 0
    if args.python:
        build_python(args.jobs, args.force)
        return 0
    for name, path in build_tools(jobs=args.jobs).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
