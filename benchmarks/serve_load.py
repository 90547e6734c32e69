"""Load check of `kvserve serve`: concurrent streaming clients on loopback, bounded in time.

    python benchmarks/serve_load.py                          # 32 clients, 256 requests, table to BENCHMARKS.md
    python benchmarks/serve_load.py --requests 64 --no-write  # smoke run
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # against a running server

Without --url it starts the server itself on a free loopback port (bundled model unless
--model), waits for /health, runs the load, checks that every KV block is free afterwards and
stops the server with SIGTERM (which must exit 0). Requests mix /v1/completions and
/v1/chat/completions, prompt lengths (prose cut from CPython's docs) and output lengths, and
half of them start with one of a few long shared prefixes, so the prefix cache has work to do.
Every request streams (SSE) with stream_options.include_usage. Client-side timings: TTFT is
the time to the first chunk with text, ITL the gap between successive text chunks (one chunk
is normally one token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import (  # noqa: E402
    command_line,
    fmt,
    load_average,
    md_table,
    percentile,
    prose_corpus,
    replace_section,
)

SECTION = "Serving load"


@dataclass
class Job:
    """One request of the workload."""

    route: str          # "completions" | "chat"
    prompt: str
    max_tokens: int
    shared_prefix: bool


@dataclass
class Result:
    """What one request measured."""

    ok: bool
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def make_jobs(n: int, seed: int, min_tokens: int, max_tokens: int) -> list[Job]:
    """Seeded mixed workload: short and long prompts, a few shared long prefixes, two routes."""
    rng = random.Random(seed)
    corpus = prose_corpus()
    prefixes = [corpus[i * 5000: i * 5000 + rng.randint(800, 1600)] for i in range(4)]
    jobs = []
    for _ in range(n):
        length = rng.choice([rng.randint(20, 200), rng.randint(200, 1200)])
        start = rng.randrange(len(corpus) - length)
        text = corpus[start:start + length]
        shared = rng.random() < 0.5
        if shared:
            text = rng.choice(prefixes) + "\n\nQuestion: " + text[:200]
        jobs.append(Job("chat" if rng.random() < 0.3 else "completions", text,
                        rng.randint(min_tokens, max_tokens), shared))
    return jobs


def request_body(job: Job, model: str) -> dict:
    """The JSON body of one streamed request."""
    body = {"model": model, "max_tokens": job.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if job.route == "chat":
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    return body


async def run_one(client: httpx.AsyncClient, url: str, job: Job, model: str, timeout: float) -> Result:
    """Send one streaming request and time its chunks."""
    path = "/v1/chat/completions" if job.route == "chat" else "/v1/completions"
    res = Result(ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + path, json=request_body(job, model), timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.completion_tokens = u["completion_tokens"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for ch in chunk["choices"]:
                    text = ch.get("text") if job.route == "completions" else ch["delta"].get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
            res.e2e = time.perf_counter() - t0
            res.ok = done and res.completion_tokens > 0
            if not res.ok:
                res.error = "stream ended without [DONE] or usage"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(url: str, jobs: list[Job], model: str, clients: int, duration: float,
                   timeout: float, headers: dict) -> tuple[list[Result], float, int]:
    """`clients` workers take jobs in order until none are left or `duration` has passed."""
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: list[Result] = []
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def worker(client: httpx.AsyncClient):
        while time.perf_counter() - start < duration:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await run_one(client, url, job, model, timeout))

    async with httpx.AsyncClient(limits=limits, headers=headers) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return results, time.perf_counter() - start, queue.qsize()


def scrape(url: str, headers: dict) -> dict[str, float]:
    """kvserve:* samples of /metrics (labels other than model_name kept in the key)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + labels] = s.value
    return out


def wait_idle(url: str, headers: dict, timeout: float = 30) -> dict[str, float]:
    """/metrics once no request runs or waits (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, headers)
        idle = m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


class ServerProcess:
    """`kvserve serve` on a free loopback port, output in a temp file."""

    def __init__(self, extra: list[str], env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-load-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-access-log", "--compile-mode", "blocking", *extra]
        env = {**os.environ, **(env or {})}
        env.pop("KVSERVE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=Path(__file__).resolve().parent.parent)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after 300 s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def report(args, results: list[Result], wall: float, skipped: int, before: dict, after: dict,
           exit_code: int | None, model: str, load_before: str) -> tuple[str, bool]:
    """The markdown section and whether the run passed (no errors, all blocks free)."""
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    free, total = after["kvserve:num_blocks_free"], after["kvserve:num_blocks_total"]
    all_free = free == total and after["kvserve:num_requests_running"] == 0
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("kvserve:num_preemptions_total",
                                                        "kvserve:prefix_cache_hits_total",
                                                        "kvserve:prefix_cache_queries_total")}
    rows = [
        ["requests done / errors / not started", f"{len(ok)} / {len(errors)} / {skipped}"],
        ["concurrent streaming clients", str(args.clients)],
        ["wall time (s)", fmt(wall, digits=1)],
        ["requests/s", fmt(len(ok) / wall)],
        ["output tokens/s", fmt(out_tokens / wall, digits=1)],
        ["prompt tokens (of which from prefix cache)", f"{prompt_tokens} ({cached}, {fmt(100 * cached / max(prompt_tokens, 1), digits=1)} %)"],
        ["TTFT p50 / p99 (ms)", f"{fmt(percentile(ttft, 50), 1e3, 0)} / {fmt(percentile(ttft, 99), 1e3, 0)}"],
        ["ITL p50 / p99 (ms)", f"{fmt(percentile(itl, 50), 1e3, 0)} / {fmt(percentile(itl, 99), 1e3, 0)}"],
        ["end-to-end p50 / p99 (s)", f"{fmt(percentile(e2e, 50))} / {fmt(percentile(e2e, 99))}"],
        ["preemptions", str(int(d["kvserve:num_preemptions_total"]))],
        ["KV blocks free after the run", f"{int(free)} / {int(total)} ({'all free' if all_free else 'LEAK'})"],
        ["server exit status after SIGTERM", "—" if exit_code is None else str(exit_code)],
    ]
    body = [
        "Streaming clients against `kvserve serve` on loopback (the load generator shares the "
        "machine's cores with the server). Mixed prompts (20–1200 characters of prose, half behind "
        f"one of 4 shared long prefixes), {args.min_tokens}–{args.max_tokens} output tokens, 30 % chat, "
        "greedy. TTFT and ITL are measured by the client (ITL = gap between text chunks).",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Model: {model}; load average before the run: {load_before}.",
        "",
        md_table(["measure", "value"], rows),
    ]
    if errors:
        body += ["", "First errors: " + "; ".join(sorted({r.error or "?" for r in errors})[:3])]
    passed = not errors and all_free and (exit_code in (None, 0))
    return "\n".join(body), passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--duration", type=float, default=600.0, help="stop starting requests after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--kv-cache-memory 512MiB --max-model-len 2048",
                   help="extra `kvserve serve` arguments when the script starts the server")
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    load_before = load_average()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    server = None if args.url else ServerProcess(args.server_args.split())
    url = args.url or server.url
    exit_code = None
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        jobs = make_jobs(args.requests, args.seed, args.min_tokens, args.max_tokens)
        before = scrape(url, headers)
        results, wall, skipped = asyncio.run(run_load(url, jobs, model, args.clients, args.duration,
                                                      args.request_timeout, headers))
        after = wait_idle(url, headers)
    finally:
        if server is not None:
            exit_code = server.stop()
    text, passed = report(args, results, wall, skipped, before, after, exit_code, model, load_before)
    print(text)
    if not args.no_write:
        replace_section(SECTION, text)
        print(f"\nwrote the '## {SECTION}' section of BENCHMARKS.md")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
