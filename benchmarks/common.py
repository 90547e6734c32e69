"""Helpers shared by the benchmark scripts: workloads from real text, machine facts, BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import random
import re
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"


def prose_corpus(max_chars: int = 400_000) -> str:
    """English prose from the Python docs shipped with CPython (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[:max_chars]


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """`num` token-id prompts of seeded random lengths in [min_len, max_len], cut from real text."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    ids = tokenizer.encode(prose_corpus())
    if len(ids) <= max_len:
        raise ValueError(f"the corpus has only {len(ids)} tokens; max_len={max_len} is too long")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        start = rng.randrange(len(ids) - n)
        prompts.append(ids[start:start + n])
    return prompts


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, None when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    """1/5/15-minute load averages as a string."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_facts() -> dict[str, str]:
    """Cores, torch threads and versions: what a reader needs to compare numbers."""
    import torch
    facts = {
        "CPU": cpu_model(),
        "cores (os.cpu_count / usable)": f"{os.cpu_count()} / {len(os.sched_getaffinity(0))}",
        "torch threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cuda: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    facts["kvserve tree"] = git_state()
    try:
        import transformers
        facts["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import llama_cpp
        facts["llama-cpp-python"] = llama_cpp.__version__
    except ImportError:
        pass
    return facts


def git_state() -> str:
    """The commit the numbers were measured at, '+ local changes' when the tree was dirty."""
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + local changes" if dirty else "")


def command_line() -> str:
    """The command that ran this script, as a reader would type it from the repo root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO_ROOT)
    except ValueError:
        pass
    args = list(sys.argv[1:])
    if "--ray-address" in args:   # added by rerun_on_hosts: not part of what the reader types
        i = args.index("--ray-address")
        del args[i:i + 2]
    return shlex.join(["python", str(script), *args])


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def replace_section(title: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the `## title` section of BENCHMARKS.md, leaving other sections alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}[ \t]*\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """A number for a table, or an em dash when not measured."""
    return "—" if x is None else f"{x * scale:.{digits}f}"


class OtherLoad:
    """CPU cores that other processes kept busy between start() and stop(): contention, measured."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        import time
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait (guest is in user)
        t = os.times()
        # this process and the children it waited for (a benchmark's engines in child processes)
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + t.children_system

    def stop(self) -> float | None:
        """Mean number of cores busy with other processes since construction."""
        try:
            end = self._sample()
        except OSError:
            return None
        wall = end[0] - self._start[0]
        if wall <= 0:
            return None
        return max(0.0, ((end[1] - self._start[1]) - (end[2] - self._start[2])) / wall)


def llama_cpp_python_peer() -> dict[str, str]:
    """The llama-cpp-python peer: version, the cmake options it was built with and its
    `system_info` line (asked in a child process, so this one loads no ggml threads)."""
    import subprocess

    from llama_build import python_build_args
    code = ("import llama_cpp; print(llama_cpp.__version__); "
            "print(llama_cpp.llama_print_system_info().decode(errors='replace').strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode:
        return {"llama-cpp-python": "not importable: " + (out.stderr.strip().splitlines() or ["?"])[-1]}
    version, _, info = out.stdout.strip().partition("\n")
    return {"llama-cpp-python": version,
            "build options": python_build_args() or "not recorded (not built by `benchmarks/llama_build.py --python`)",
            "system_info": info.strip()}


def llama_server_peer(binary: Path | str, log_text: str) -> dict[str, str]:
    """The llama-server peer: its binary, build options (when llama_build.py built it) and the
    `system_info` line of its log."""
    from llama_build import build_dir, build_options
    ours = Path(binary).resolve().is_relative_to(build_dir().resolve())
    info = next((ln.split("system_info:", 1)[1].strip() for ln in log_text.splitlines() if "system_info:" in ln),
                None)
    if info is None:  # logged at trace level only: ask the libllama beside the binary
        info = library_system_info(Path(binary).resolve().parent / "libllama.so")
    return {"llama-server": str(binary),
            "build options": " ".join(build_options()) if ours else "unknown (a binary built elsewhere)",
            "system_info": info}


def library_system_info(lib: Path) -> str:
    """llama_print_system_info() of a libllama.so, called through ctypes in a child process."""
    import subprocess
    code = ("import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).llama_print_system_info; "
            "f.restype = ctypes.c_char_p; print(f().decode(errors='replace').strip())")
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=120)
    if out.returncode or not out.stdout.strip():
        return f"unknown (not in the log, and {lib} did not say)"
    return out.stdout.strip() + f" (llama_print_system_info of {lib.name})"


def peer_lines(peer: dict[str, str]) -> str:
    """A peer's facts as markdown bullets, for a report and the console alike."""
    return "\n".join(f"- {k}: `{v}`" for k, v in peer.items())


def rerun_on_hosts(hosts: int = 3) -> int:
    """Run this script again inside host 0 of a fresh NetnsCluster (separate network hosts: a 0-CPU
    Ray head in host 0, a 1-CPU Ray worker node in each other host), with `--ray-address` added;
    its exit status. Its output streams through; the cluster is removed afterwards."""
    from kvserve.distributed.netns import QUICK_FAILURE_DETECTION, NetnsCluster
    with NetnsCluster(hosts=hosts) as cluster:
        address = cluster.start_ray(head_num_cpus=0, num_cpus=1, workers=range(1, hosts),
                                    env=QUICK_FAILURE_DETECTION)
        print(f"Ray on {hosts} network hosts: head {address} (0 CPUs), workers "
              f"{', '.join(h.ip for h in cluster.hosts[1:])} (1 CPU each)", flush=True)
        argv = [sys.executable, str(Path(sys.argv[0]).resolve()), *sys.argv[1:], "--ray-address", address]
        child = cluster.popen(cluster.hosts[0], argv, stdout=None, stderr=None)
        return child.wait()
