"""Start-up: time to the first token of `kvserve generate` from process launch, on a fresh cache and
again on the cache the first start left, for both bundled models; LLM() load time and RSS at idle;
llama-cpp-python (`Llama(model_path)`) on the same GGUF files in the same run.

A fresh cache is an empty temporary folder for kvserve's caches (XDG_CACHE_HOME: weights, tokenizer,
compiled artifacts) and for torch's Inductor cache (TORCHINDUCTOR_CACHE_DIR); the C++ kernels are
those `kvserve build-kernels` installs (as `make install` does), and one more first start per model
builds them too (KVSERVE_KERNEL_CACHE in its empty folder).

    .venv/bin/python benchmarks/startup.py [--max-tokens 8] [--models smollm2,gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from common import command_line, fmt, git_state, machine_facts, md_table, replace_section
from tqdm.auto import tqdm

MODELS = {"smollm2": None, "gemma3-270m": "gemma3-270m"}   # name -> kvserve's model argument
PROMPT = "The three most useful things to know about a KV cache are"

# In a fresh process: LLM() (or Llama()), one greedy request, then idle: load time, first token
# after launch, RSS at idle (the kvserve engine once its background compile has finished).
KVSERVE_PROBE = """
import json, sys, time
t0 = time.perf_counter()
from kvserve import LLM, SamplingParams
llm = LLM(None if sys.argv[1] == "None" else sys.argv[1])
load = time.perf_counter() - t0
llm.generate(sys.argv[2], SamplingParams(temperature=0, max_tokens=int(sys.argv[3])), use_tqdm=False)
llm.wait_compiled()
from kvserve.engine.memory import rss_bytes
print(json.dumps({"load": load, "rss": rss_bytes()}))
"""
LLAMA_PROBE = """
import json, os, sys, time
def since_launch():   # as kvserve.startup.seconds_since_launch, without importing kvserve (and torch)
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
t0 = time.perf_counter()
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=2048, verbose=False)
load = time.perf_counter() - t0
first = None
for _ in llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0, stream=True):
    first = first or since_launch()
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(json.dumps({"load": load, "first": first, "rss": rss}))
"""


def cache_env(folder: str) -> dict:
    return {**os.environ, "XDG_CACHE_HOME": folder, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}


def kvserve_generate(model: str | None, env: dict, max_tokens: int) -> float:
    """Seconds from launch to the first token, as `kvserve generate` reports them."""
    cmd = [sys.executable, "-m", "kvserve.cli", "generate", PROMPT, "--max-tokens", str(max_tokens), "--quiet"]
    if model is not None:
        cmd += ["--model", model]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"kvserve generate failed:\n{done.stderr[-2000:]}")
    return float(re.search(r"first token ([\d.]+) s after launch", done.stderr).group(1))


def probe(code: str, args: list[str], env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"probe failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_available() -> bool:
    return subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def measure(name: str, max_tokens: int, with_llama: bool) -> list[dict]:
    """Rows for one model: the first start on an empty cache, then the second start on it."""
    from kvserve.model.loader import resolve_model_path
    model = MODELS[name]
    gguf = resolve_model_path(model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-startup-") as folder:
        env = cache_env(folder)
        for start in ("first", "second"):
            row = {"model": name, "start": start, "first_token": kvserve_generate(model, env, max_tokens)}
            row.update(probe(KVSERVE_PROBE, [str(model), PROMPT, str(max_tokens)], env))
            if with_llama:
                peer = probe(LLAMA_PROBE, [gguf, PROMPT, str(max_tokens)], env)
                row.update({f"llama_{k}": v for k, v in peer.items()})
            rows.append(row)
    with tempfile.TemporaryDirectory(prefix="kvserve-startup-") as folder:
        env = {**cache_env(folder), "KVSERVE_KERNEL_CACHE": os.path.join(folder, "kernels")}
        row = {"model": name, "start": "first, kernels not installed",
               "first_token": kvserve_generate(model, env, max_tokens)}
        rows.append({**row, **probe(KVSERVE_PROBE, [str(model), PROMPT, str(max_tokens)], env)})
    return rows


def table(rows: list[dict]) -> str:
    header = ["model", "start", "kvserve generate: first token after launch (s)", "LLM() load (s)",
              "llama-cpp-python: first token after launch (s)", "Llama() load (s)",
              "RSS at idle kvserve (GiB)", "RSS at idle llama.cpp (GiB)"]
    body = [[r["model"], r["start"], fmt(r["first_token"]), fmt(r["load"]), fmt(r.get("llama_first")),
             fmt(r.get("llama_load")), fmt(r["rss"], 2**-30), fmt(r.get("llama_rss"), 2**-30)] for r in rows]
    return md_table(header, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = p.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    with_llama = llama_cpp_available()
    t0 = time.perf_counter()
    from kvserve import native
    native.build_installed()   # as `make install` (kvserve build-kernels) leaves them
    rows = []
    for name in tqdm(names, desc="models", unit="model"):
        rows.extend(measure(name, args.max_tokens, with_llama))
    text = table(rows)
    print(text)
    facts = machine_facts()
    notes = [f"`{command_line()}` at {git_state()}, {time.perf_counter() - t0:.0f} s.",
             "Each start is a fresh process; the first on an empty cache (XDG_CACHE_HOME and "
             "TORCHINDUCTOR_CACHE_DIR in a new temporary folder) with the C++ kernels `kvserve "
             "build-kernels` built at install, the second on what the first left; 'kernels not "
             "installed' is a first start that also builds the kernels (KVSERVE_KERNEL_CACHE in the "
             "empty folder: a pip install without `kvserve build-kernels`). "
             "kvserve runs its default configuration (compile_mode=background: the first tokens decode "
             "eagerly while the graphs compile); RSS at idle is read after one request, once the "
             "background compile has finished.",
             "llama-cpp-python: " + ("`Llama(model_path, n_ctx=2048)`, the same GGUF." if with_llama else
                                     "not installed (`import llama_cpp` failed): its columns are empty."),
             "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + "."]
    if not args.no_write:
        replace_section("Start-up", text + "\n\n" + "\n\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
