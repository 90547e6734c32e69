"""Serving against llama.cpp's own server: the same streaming workload, both servers, one run.

    python benchmarks/serve_peers.py                      # 32 clients, 32 prompts, 128 tokens each
    python benchmarks/serve_peers.py --quick --no-write   # smoke run: 4 clients, 4 prompts, 16 tokens
    python benchmarks/serve_peers.py --llama-server /path/to/llama-server   # an existing binary
    python benchmarks/serve_peers.py --build-only         # just build llama-server into the cache

The workload: N concurrent streaming clients, prompts of 64-512 tokens cut (seeded) from prose
with the bundled model's tokenizer, sent as the same text to both servers' /v1/completions,
a fixed number of output tokens each (greedy, temperature 0, EOS ignored with `ignore_eos`,
which both servers accept). Client-side timings: TTFT is the time to the first chunk with text,
ITL the gap between successive text chunks. Output tokens are counted from the server's usage,
checked against the number asked for.

llama-server is built, when missing, by benchmarks/llama_build.py from the llama.cpp tree vendored
in the llama-cpp-python sdist into ~/.cache/kvserve/llama-server/ (cmake, Release, this CPU's
vector extensions except AMX; 10+ minutes on two cores); the report gives its build options and
the `system_info` line of its log. The servers run one after the other, each alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import serve_load  # noqa: E402
from common import (  # noqa: E402
    OtherLoad,
    command_line,
    fmt,
    llama_server_peer,
    load_average,
    machine_facts,
    make_prompts,
    md_table,
    peer_lines,
    percentile,
    replace_section,
)
from llama_build import CACHE_DIR, build_tool  # noqa: E402
from serve_load import Job, Result, ServerProcess, run_load  # noqa: E402


def build_llama_server() -> Path:
    """The llama-server binary, built with llama.cpp's other tools when missing (llama_build.py)."""
    return build_tool("llama-server")


SECTION = "Serving against llama-server"
KVSERVE_ARGS = "--kv-cache-memory 1GiB --max-model-len 2048"


_base_request_body = serve_load.request_body


def _with_ignore_eos(job: Job, model: str) -> dict:
    """serve_load's request body plus `ignore_eos`, so every request runs to max_tokens."""
    return {**_base_request_body(job, model), "ignore_eos": True}


class LlamaServerProcess(ServerProcess):
    """llama.cpp's `llama-server` on a free loopback port, stopped like `kvserve serve` (SIGTERM)."""

    def __init__(self, binary: Path, gguf: str, parallel: int, ctx: int, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.cmd = [str(binary), "-m", gguf, "-np", str(parallel), "-c", str(ctx), "--cont-batching",
                    "-t", str(threads), "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.tail()}")
            try:  # 503 while the model loads, 200 once slots are ready
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server not healthy after 300 s:\n{self.tail()}")


def wait_compiled(server: ServerProcess, timeout: float = 900.0) -> float:
    """Seconds spent waiting for `kvserve serve`'s background compile to finish (by its log), so the
    timed run measures the compiled engine; 0 when it compiles nothing in the background."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = Path(server.log.name).read_text(errors="replace")
        if "in the background" not in text or any(s in text for s in ("steps now run the compiled",
                                                                      "compiling failed", "runs eagerly")):
            break
        if server.proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {server.proc.returncode}:\n{server.tail()}")
        time.sleep(0.5)
    return time.monotonic() - t0


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process and its waited-for children, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


@dataclass
class Measured:
    """One server's run of the workload."""

    name: str
    command: str
    results: list[Result]
    wall: float
    others: float | None       # cores busy with processes other than this script and the server
    server_cores: float | None  # mean cores the server process used
    client_cores: float | None = None  # mean cores this script's clients used
    exit_code: int | None = None
    note: str = ""              # what the server said it picked, for the report
    peer: dict | None = None    # llama-server's build options and system_info line

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def out_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.ok)

    @property
    def tok_s(self) -> float:
        return self.out_tokens / self.wall

    def ttft(self, q: float) -> float | None:
        return percentile([r.ttft for r in self.ok], q)

    def itl(self, q: float) -> float | None:
        return percentile([x for r in self.ok for x in r.itl], q)


def measure(name: str, server: ServerProcess, command: str, prompts: list[list[int]],
            warmup: list[list[int]], args) -> Measured:
    """Warm the server up (`warmup` prompts at once, 4 tokens each), then run the workload and time it."""
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    print(f"{name}: warming up with {len(warmup)} concurrent short requests", flush=True)
    warm = asyncio.run(run_load(server.url, [Job("completions", p, 4, False) for p in warmup], model,
                                len(warmup), math.inf, args.request_timeout, {}))[0]
    failed = [r for r in warm if not r.ok]
    if failed:
        raise RuntimeError(f"{name}: a warm-up request failed: {failed[0].error}\n{server.tail()}")
    jobs = [Job("completions", p, args.max_tokens, False) for p in prompts]
    print(f"{name}: {len(jobs)} requests, {args.clients} clients, {args.max_tokens} tokens each ...", flush=True)
    cpu0, mon, own0 = process_cpu_seconds(server.proc.pid), OtherLoad(), os.times()
    results, wall, _ = asyncio.run(run_load(server.url, jobs, model, args.clients, math.inf,
                                            args.request_timeout, {}))
    busy, cpu1, own1 = mon.stop(), process_cpu_seconds(server.proc.pid), os.times()
    server_cores = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / wall
    others = None if busy is None or server_cores is None else max(0.0, busy - server_cores)
    client = (own1.user + own1.system - own0.user - own0.system) / wall
    m = Measured(name, command, results, wall, others, server_cores, client)
    print(f"{name}: {m.tok_s:.1f} output tok/s, wall {wall:.1f} s, {len(m.errors)} errors", flush=True)
    return m


def token_check(m: Measured, max_tokens: int) -> str:
    """Requests that produced exactly max_tokens (by usage), and text chunks received / tokens."""
    exact = sum(r.completion_tokens == max_tokens for r in m.ok)
    chunks = sum(len(r.itl) + (r.ttft is not None) for r in m.ok)
    return f"{exact} / {len(m.results)}; {chunks} / {m.out_tokens}"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def report(runs: list[Measured], args, facts: dict, load_before: str, load_after: str,
           n_prompt_tokens: int) -> tuple[str, bool | None]:
    """The markdown section, and whether the issue's target is met (None when not measured)."""
    header = ["measure", *(m.name for m in runs)]
    rows = [
        ["requests done / errors", *(f"{len(m.ok)} / {len(m.errors)}" for m in runs)],
        [f"requests with exactly {args.max_tokens} tokens; text chunks / output tokens",
         *(token_check(m, args.max_tokens) for m in runs)],
        ["prompt tokens (server's count)", *(str(sum(r.prompt_tokens for r in m.ok)) for m in runs)],
        ["output tokens/s", *(fmt(m.tok_s, digits=1) for m in runs)],
        ["total wall (s)", *(fmt(m.wall, digits=1) for m in runs)],
        ["TTFT p50 / p99 (s)", *(f"{fmt(m.ttft(50))} / {fmt(m.ttft(99))}" for m in runs)],
        ["ITL p50 / p99 (ms)", *(f"{fmt(m.itl(50), 1e3, 0)} / {fmt(m.itl(99), 1e3, 0)}" for m in runs)],
        ["mean CPU cores: server; clients; others", *(f"{fmt(m.server_cores)}; {fmt(m.client_cores)}; {fmt(m.others)}"
                                                      for m in runs)],
        ["exit status after SIGTERM", *("—" if m.exit_code is None else str(m.exit_code) for m in runs)],
    ]
    ours = next((m for m in runs if m.name == "kvserve"), None)
    peer = next((m for m in runs if m.name == "llama-server"), None)
    body = [
        f"Command: `{command_line()}`",
        "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items()) + ".",
        f"Load average (1/5/15 min) before / after: {load_before} -> {load_after}.",
        "",
        f"Workload: {args.clients} concurrent streaming clients, {args.prompts} prompts of "
        f"{args.min_prompt}-{args.max_prompt} tokens (seeded, seed {args.seed}; {n_prompt_tokens} prompt tokens "
        "in all) cut from CPython's `pydoc_data.topics` prose with the bundled model's tokenizer and sent "
        "as the same token ids to both servers' `/v1/completions`; "
        f"{args.max_tokens} output tokens each (greedy, temperature 0, `ignore_eos`), streamed with "
        "`stream_options.include_usage`. The servers run one after the other, each after a warm-up "
        f"({args.clients} concurrent requests of other prose, 16-64 prompt tokens, 4 output tokens). TTFT and ITL are measured by the client (ITL = gap between text chunks); "
        "output tokens are the servers' usage counts. CPU cores: the server process's; the clients' (this "
        "script, on the same machine); others': CPU other processes kept busy "
        "during the timed run (/proc/stat minus this script and the server); above ~0.2 the machine "
        "was shared and that column is slowed.",
        "",
        *(f"- {m.name}: `{m.command}`" + (f" ({m.note})" if m.note else "") for m in runs),
        *(f"\nThe peer's build:\n\n{peer_lines(m.peer)}" for m in runs if m.peer),
        "",
        md_table(header, rows),
    ]
    met = None
    if ours is not None and peer is not None:
        body += ["", md_table(["kvserve / llama-server", "ratio"], [
            ["output tokens/s", ratio(ours.tok_s, peer.tok_s)],
            ["total wall", ratio(ours.wall, peer.wall)],
            ["TTFT p50", ratio(ours.ttft(50), peer.ttft(50))],
            ["TTFT p99", ratio(ours.ttft(99), peer.ttft(99))],
            ["ITL p50", ratio(ours.itl(50), peer.itl(50))],
        ])]
        clean = not ours.errors and not peer.errors
        met = (clean and ours.ttft(50) is not None and peer.ttft(50) is not None
               and ours.tok_s >= 3 * peer.tok_s and ours.ttft(50) < peer.ttft(50))
        body += ["", f"Issue 13's target (kvserve output tok/s >= 3x llama-server's, TTFT p50 below "
                 f"llama-server's, no errors): **{'met' if met else 'not met'}** "
                 f"({ratio(ours.tok_s, peer.tok_s)} tok/s, TTFT p50 {fmt(ours.ttft(50))} s vs "
                 f"{fmt(peer.ttft(50))} s)."]
    for m in runs:
        if m.errors:
            body += ["", f"First errors ({m.name}): " + "; ".join(sorted({r.error or "?" for r in m.errors})[:3])]
    if args.quick:
        body += ["", "(--quick smoke run: too small to compare the servers.)"]
    return "\n".join(body), met


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (and llama-server -np)")
    p.add_argument("--prompts", type=int, default=32, help="requests in all")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 clients, 4 prompts, 16 tokens")
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    p.add_argument("--engines", default="kvserve,llama-server", help="comma-separated, run in this order")
    p.add_argument("--server-args", default=KVSERVE_ARGS, help="extra `kvserve serve` arguments")
    p.add_argument("--llama-server", type=Path, default=None,
                   help=f"an existing llama-server binary (default: build one into {CACHE_DIR})")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    p.add_argument("--ctx-slack", type=int, default=64,
                   help="llama-server -c is clients * (max-prompt + max-tokens + this)")
    p.add_argument("--request-timeout", type=float, default=1200.0)
    p.add_argument("--build-only", action="store_true", help="build llama-server into the cache and stop")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.prompts, args.max_tokens = 4, 4, 16
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"kvserve", "llama-server"}
    if unknown:
        p.error(f"unknown engines: {', '.join(sorted(unknown))}")

    binary = args.llama_server
    if binary is None and ("llama-server" in engines or args.build_only):
        binary = build_llama_server()
    if args.build_only:
        print(binary)
        return 0
    if binary is not None and not binary.exists():
        p.error(f"no llama-server at {binary}")

    from kvserve.model.loader import resolve_model_path
    from kvserve.model.tokenizer import Tokenizer
    gguf = str(resolve_model_path(None))
    tokenizer = Tokenizer.load(gguf)
    prompts = make_prompts(tokenizer, args.prompts, args.min_prompt, args.max_prompt, args.seed)
    # Other text than the workload's (another seed), so no prefix cache starts the timed run warm.
    warmup = make_prompts(tokenizer, args.clients, 16, 64, args.seed + 1000)
    facts = machine_facts()
    load_before = load_average()
    serve_load.request_body = _with_ignore_eos  # serve_load.run_one builds every body with it

    runs: list[Measured] = []
    for name in engines:
        if name == "kvserve":
            server = ServerProcess(args.server_args.split())
            print(f"kvserve: waited {wait_compiled(server):.0f} s for its background compile", flush=True)
            command = "kvserve serve " + args.server_args
            picked = [ln.split("kvserve: ", 1)[1] for ln in Path(server.log.name).read_text().splitlines()
                      if ln.startswith(("INFO kvserve: weights:", "INFO kvserve: KV format:"))]
            note = "; ".join(picked)
        else:
            ctx = args.clients * (args.max_prompt + args.max_tokens + args.ctx_slack)
            server = LlamaServerProcess(binary, gguf, args.clients, ctx, args.threads)
            command, note = " ".join(["llama-server", *server.cmd[1:]]), ""
        try:
            m = measure(name, server, command, prompts, warmup, args)
        finally:
            code = server.stop()
        m.exit_code, m.note = code, note
        if name == "llama-server":
            m.peer = llama_server_peer(binary, Path(server.log.name).read_text(errors="replace"))
        runs.append(m)
    load_after = load_average()

    text, met = report(runs, args, facts, load_before, load_after, sum(map(len, prompts)))
    print(text)
    if not args.no_write:
        replace_section(SECTION, text)
        print(f"\nwrote the '## {SECTION}' section of BENCHMARKS.md")
    bad = any(m.errors or any(r.completion_tokens != args.max_tokens for r in m.ok) for m in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
