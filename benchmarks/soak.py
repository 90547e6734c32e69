"""Soak: does the server's memory level off under churn? Rounds of streamed requests, a share of
them dropped by their clients mid-stream, against one `kvserve serve`; the server's RSS (and the share of
KV blocks requests still own) after every round, with glibc's malloc as the engine tunes it (freed heap kept for
reuse, up to its trim threshold) and as glibc leaves it (KVSERVE_MALLOC_TUNING=0), in the same run.

    .venv/bin/python benchmarks/soak.py [--rounds 3] [--streams 500] [--clients 32] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, git_state, machine_facts, md_table, replace_section  # noqa: E402
from serve_load import Job, ServerProcess, make_jobs, request_body, wait_idle  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from kvserve.engine.async_engine import IDLE_RELEASE_SECONDS  # noqa: E402

CONFIGS = {"default (malloc tuned)": {}, "KVSERVE_MALLOC_TUNING=0": {"KVSERVE_MALLOC_TUNING": "0"}}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


POOL_MAPPING_KB = 512 << 10   # the KV pool is one private anonymous mapping of its whole budget (1 GiB here)


def pool_resident_mib(pid: int) -> float:
    """Resident MiB of the mappings as large as a KV pool (kv/formats.py `zeroed`: one anonymous
    mapping per storage, committed page by page as blocks are first written)."""
    total, size = 0, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1])
            elif line.startswith("Rss:") and size >= POOL_MAPPING_KB:
                total += int(line.split()[1])
    return total / 1024


async def one(client: httpx.AsyncClient, url: str, job: Job, drop_after: int | None) -> str:
    """A streamed request; with `drop_after`, the client leaves after that many chunks."""
    path = "/v1/chat/completions" if job.route == "chat" else "/v1/completions"
    try:
        async with client.stream("POST", url + path, json=request_body(job, "default"), timeout=300) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return "dropped"
            return "done"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def round_of(url: str, jobs: list[Job], clients: int, drop: float, rng: random.Random) -> dict[str, int]:
    queue = list(jobs)
    counts: dict[str, int] = {}

    async def worker(client):
        while queue:
            job = queue.pop()
            outcome = await one(client, url, job, rng.randint(1, 8) if rng.random() < drop else None)
            counts[outcome] = counts.get(outcome, 0) + 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return counts


def soak(name: str, env: dict, args) -> list[dict]:
    server = ServerProcess(["--max-model-len", "2048", "--served-model-name", "default"], env=env)
    rows = []
    try:
        wait_idle(server.url, {})
        pid = server.proc.pid
        rows.append({"config": name, "round": "started", "rss": rss_mib(pid), "pool": pool_resident_mib(pid),
                     "usage": 0.0, "outcomes": ""})
        rng = random.Random(7)
        for r in tqdm(range(args.rounds), desc=name, unit="round", leave=False):
            jobs = make_jobs(args.streams, seed=100 + r, min_tokens=8, max_tokens=args.max_tokens)
            t0 = time.perf_counter()
            counts = asyncio.run(round_of(server.url, jobs, args.clients, args.drop, rng))
            m = wait_idle(server.url, {}, timeout=60)
            busy = rss_mib(server.proc.pid)
            time.sleep(IDLE_RELEASE_SECONDS + 1)
            rows.append({"config": name, "round": str(r + 1), "busy": busy, "rss": rss_mib(pid),
                         "pool": pool_resident_mib(pid),
                         "usage": m["kvserve:kv_cache_usage_perc"],
                         "outcomes": ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                         "seconds": time.perf_counter() - t0})
    finally:
        server.stop()
    return rows


def table(rows: list[dict]) -> str:
    header = ["configuration", "after round", "RSS as the round ends (MiB)", "RSS idle (MiB)",
              "idle growth since start (MiB)", "of it, KV pool pages (MiB)", "outside the pool (MiB)",
              "KV blocks owned by requests", "streams (outcome count)", "round (s)"]
    body, base = [], {}
    for r in rows:
        base.setdefault(r["config"], r)
        body.append([r["config"], r["round"], f"{r['busy']:.0f}" if "busy" in r else "-", f"{r['rss']:.0f}",
                     f"{r['rss'] - base[r['config']]['rss']:+.0f}",
                     f"{r['pool'] - base[r['config']]['pool']:+.0f}",
                     f"{r['rss'] - r['pool'] - base[r['config']]['rss'] + base[r['config']]['pool']:+.0f}",
                     f"{r['usage']:.0%}", r["outcomes"] or "-", f"{r['seconds']:.0f}" if "seconds" in r else "-"])
    return md_table(header, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--drop", type=float, default=0.3, help="share of streams the client leaves mid-way")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = [row for name, env in CONFIGS.items() for row in soak(name, env, args)]
    text = table(rows)
    print(text)
    notes = [f"`{command_line()}` at {git_state()}, {time.perf_counter() - t0:.0f} s.",
             f"Each round: {args.streams} streamed requests (serve_load.py's mixed workload: completions and "
             f"chats, short and long prompts, shared prefixes; up to {args.max_tokens} tokens) from "
             f"{args.clients} clients, {args.drop:.0%} of them dropped by the client after 1-8 chunks; RSS "
             "read as the last request ends and again once the server has been idle "
             f"{IDLE_RELEASE_SECONDS + 1:.0f} s (the engine hands freed heap back after {IDLE_RELEASE_SECONDS:.0f} s idle). \"KV pool pages\": resident pages of "
             f"the mappings of {POOL_MAPPING_KB >> 10} MiB or more (the pool is one anonymous mapping of its "
             "budget, committed as blocks are first written: it grows until every block has been used once).",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + "."]
    if not args.no_write:
        replace_section("Soak", text + "\n\n" + "\n\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
