"""Tiered KV storage: TTFT of a repeated long prompt served cold, from the device prefix cache, and
from the CPU, disk and Redis tiers; and throughput under memory pressure with swap vs recompute.

Each tier is measured on its own engine (only that tier configured): the prompt runs once, its
cached blocks are written down (`reset_prefix_cache(offload=True)`), and the next run loads them
back. A private redis-server is started on a free loopback port for the Redis row.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    command_line,
    fmt,
    load_average,
    machine_facts,
    make_prompts,
    md_table,
    replace_section,
)

from kvserve import LLM, SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


# ---- a private redis-server ---------------------------------------------------------------
def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    """redis-server on a free loopback port, no persistence; returns (process, URL)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (make install installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--dir", workdir,
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


# ---- TTFT by source ------------------------------------------------------------------------
def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request, and its prompt tokens served from cache."""
    out = llm.generate([prompt], ONE_TOKEN, use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time, out.num_cached_tokens


def measure_source(llm: LLM, prompt: list[int], repeats: int, before) -> tuple[float, int]:
    """Median TTFT over `repeats` runs, calling `before()` ahead of each."""
    times, cached = [], 0
    for _ in range(repeats):
        before()
        t, cached = ttft(llm, prompt)
        times.append(t)
    return statistics.median(times), cached


def ttft_rows(args, prompt: list[int], engine_opts: dict, workdir: str) -> list[list[str]]:
    rows = []
    llm = LLM(**engine_opts)
    ttft(llm, prompt)                                               # warm-up (first-call overheads)
    cold, _ = measure_source(llm, prompt, args.repeats, llm.reset_prefix_cache)
    rows.append(["cold (no cache)", fmt(cold, 1e3, 0), "0", "—", "1.0x"])
    device, cached = measure_source(llm, prompt, args.repeats, lambda: None)
    rows.append(["device prefix cache", fmt(device, 1e3, 0), str(cached), "—", f"{cold / device:.1f}x"])
    del llm
    gc.collect()
    redis_proc, redis_url = start_redis(workdir)
    try:
        tiers = {"CPU tier": "cpu:2GiB", "disk tier": f"disk:{workdir}/disk:4GiB", "Redis tier": redis_url}
        for label, spec in tiers.items():
            llm = LLM(**engine_opts, kv_tiers=[spec])
            ttft(llm, prompt)                                       # computes the prompt once
            t, cached = measure_source(llm, prompt, args.repeats, partial(llm.reset_prefix_cache, offload=True))
            stats = next(iter(llm.get_metrics()["kv_tiers"].values()))
            per_run = stats["bytes_read"] / max(1, args.repeats) / 2**20
            note = " (files in the page cache)" if label == "disk tier" else ""
            rows.append([label + note, fmt(t, 1e3, 0), str(cached), f"{per_run:.1f}", f"{cold / t:.1f}x"])
            del llm
            gc.collect()
    finally:
        redis_proc.kill()
        redis_proc.wait()
    return rows


# ---- throughput under memory pressure -------------------------------------------------------
def pressure_rows(args, prompts: list[list[int]], engine_opts: dict) -> list[list[str]]:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows, reference = [], None
    for mode, swap in (("recompute", 0.0), ("swap", args.swap_space), ("auto", args.swap_space)):
        walls = []
        for _ in range(args.pressure_repeats):  # best of: the machine may be shared
            llm = LLM(**engine_opts, swap_space=swap, preemption_mode=mode)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
        wall = min(walls)
        m = llm.get_metrics()
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = reference or tokens
        rows.append([mode, f"{m['generation_tokens'] / wall:.1f}", f"{wall:.1f}", str(m["num_preemptions"]),
                     str(m["num_swap_preemptions"]), str(m["num_swapped_out_blocks"]),
                     f"{m['prompt_tokens'] + m['generation_tokens']}",
                     str(m["kv_projection_rows"]),
                     "yes" if tokens == reference else "NO"])
        del llm
        gc.collect()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--request-prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--pressure-blocks", type=int, default=24, help="device pool (blocks) for the pressure runs")
    p.add_argument("--pressure-repeats", type=int, default=2, help="runs per mode; the fastest is reported")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of swap for the swap/auto runs")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    probe = LLM(max_model_len=args.max_model_len, kv_cache_memory="512MiB", dtype=args.dtype)
    tok, block_bytes = probe.get_tokenizer(), probe.engine.storage.bytes_per_block
    prompt = make_prompts(tok, 1, args.prompt_len, args.prompt_len, seed=1)[0]
    prompts = make_prompts(tok, args.num_requests, args.request_prompt_len, args.request_prompt_len, seed=2)
    del probe
    gc.collect()
    blocks_for_prompt = args.max_model_len // 16 + 8
    ttft_opts = dict(max_model_len=args.max_model_len, kv_cache_memory=blocks_for_prompt * block_bytes, dtype=args.dtype)
    pressure_opts = dict(max_model_len=args.pressure_blocks * 16, kv_cache_memory=args.pressure_blocks * block_bytes,
                         dtype=args.dtype)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="kvserve-tiers-") as workdir:
        ttft_table = md_table(["prompt served from", "TTFT (ms, median)", "prompt tokens from cache",
                               "MiB read from the tier per run", "speed-up vs cold"],
                              ttft_rows(args, prompt, ttft_opts, workdir))
    print(ttft_table)
    pressure_table = md_table(["preemption", "output tokens/s", "wall (s)", "preemptions", "by swap",
                               "blocks swapped out", "tokens (prompt + output)", "K/V rows computed per layer",
                               "same tokens as recompute"],
                              pressure_rows(args, prompts, pressure_opts))
    print(pressure_table)
    if args.no_write:
        return 0
    facts = machine_facts()
    body = "\n".join([
        f"`{command_line()}`",
        "",
        f"Machine: {facts['CPU']}, {facts['cores (os.cpu_count / usable)']} cores, torch threads "
        f"{facts['torch threads']}, {facts['device']}; load average before: {load_before}.",
        "",
        f"### TTFT of a repeated {len(prompt)}-token prompt (SmolLM2-135M, max_model_len {args.max_model_len}, "
        f"KV {block_bytes // 16:,} B/token)",
        "",
        "Each tier row is an engine with only that tier: the prompt ran once, its blocks were written down "
        "(`reset_prefix_cache(offload=True)`) and the measured run loaded them back (entries checked by "
        "CRC-32, then copied into fresh device blocks). The last prompt token is always recomputed.",
        "",
        ttft_table,
        "",
        f"### Throughput under memory pressure: {args.num_requests} requests of {args.request_prompt_len} "
        f"prompt + {args.output_len} output tokens (greedy, ignore_eos), a {args.pressure_blocks}-block pool "
        f"({args.pressure_blocks * 16} tokens), best of {args.pressure_repeats} runs",
        "",
        "`auto` picks per preemption by estimated cost (bytes to copy out and back at the measured copy "
        "rate vs tokens to recompute at the measured prefill rate). \"K/V rows computed per layer\" counts "
        "every token whose K/V was projected, recomputation included. On a small CPU model decode steps "
        "dominate the wall time and recomputing short prompts is cheap, so throughput moves little (and a "
        "shared machine adds noise of that size); the K/V rows are the work swap saves.",
        "",
        pressure_table,
    ])
    replace_section("Tiered KV storage", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
