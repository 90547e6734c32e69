"""Colocated against disaggregated serving on separate network hosts, one mixed workload.

    python benchmarks/disaggregated.py                 # the run in BENCHMARKS.md ("Disaggregated serving")
    python benchmarks/disaggregated.py --chats 8 --long 4 --no-write      # a smoke run

Needs root (network namespaces; kvserve/distributed/netns.py): the script makes three network
hosts, a 0-CPU Ray head in host 0 and a 1-CPU Ray worker node in hosts 1 and 2, and runs itself
again inside host 0, where it deploys, in turn:
- colocated: `kvserve serve --replicas 2` (prefix routing), one engine replica per worker host;
- disaggregated: `kvserve serve --disaggregate 1:1`, a prefill replica on one worker host and a
  decode replica on the other, the KV moving between them over the TCP KV connector.

The workload, the same for both: `--chat-clients` clients each sending streamed chat requests in
turn (a 30-60-token question, `--chat-tokens` output tokens) until `--chats` are done, while one
more client sends `--long` completions of `--long-tokens`-token prompts (prose cut seeded from
CPython's docs; `--long-output` tokens each) every `--long-every` seconds. Greedy, `ignore_eos`.

Measured per mode: the chats' inter-token latency p50/p99 (gaps between streamed chunks with
text, client-side), TTFT p50/p99 of chats and of long prompts, output tokens/s (usage counts over
the run's wall time), and for the disaggregated run the KV moved per request and the time to
receive it (the decode replica's `kvserve:kv_transfer_received_bytes_total` and
`_receive_seconds_total` over `_received_requests_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import (  # noqa: E402
    command_line,
    fmt,
    load_average,
    machine_facts,
    md_table,
    percentile,
    prose_corpus,
    replace_section,
    rerun_on_hosts,
)
from multi_replica import scrape, summed  # noqa: E402
from tqdm import tqdm  # noqa: E402

SECTION = "Disaggregated serving"
PORT = 8000
MODES = {"colocated": ["--replicas", "2"], "disaggregated": ["--disaggregate", "1:1"]}


@dataclass
class Result:
    kind: str                       # "chat" or "long"
    ok: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass
class Run:
    mode: str
    results: list[Result]
    wall: float
    start_s: float
    transfer: dict[str, float]


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict, kind: str) -> Result:
    """One streamed request: time to the first text, the gaps between text chunks, tokens."""
    res = Result(kind)
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + path, json=body, timeout=600) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line[6:] == "[DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                               for c in chunk.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
        res.ok = res.tokens > 0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def chat_body(question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def long_body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def workload(url: str, args, questions: list[str], documents: list[str]) -> tuple[list[Result], float]:
    """The chat clients and the long-prompt client, all at once; a tqdm bar counts finished requests."""
    bar = tqdm(total=len(questions) + len(documents), unit="req")
    results: list[Result] = []
    pending = list(questions)

    async def chatter(client):
        while pending:
            results.append(await stream(client, url, "/v1/chat/completions",
                                        chat_body(pending.pop(), args.chat_tokens), "chat"))
            bar.update(1)

    async def one_long(client, doc: str, delay: float):
        await asyncio.sleep(delay)
        results.append(await stream(client, url, "/v1/completions", long_body(doc, args.long_output), "long"))
        bar.update(1)

    limits = httpx.Limits(max_connections=args.chat_clients + len(documents) + 2)
    start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(chatter(client) for _ in range(args.chat_clients)),
                             *(one_long(client, d, 1 + i * args.long_every) for i, d in enumerate(documents)))
    bar.close()
    return results, time.perf_counter() - start


def deploy(mode: str, args, url: str):
    """`kvserve serve` of `mode` in this host, ready and warmed up; its process."""
    import subprocess
    kvserve = str(Path(sys.executable).parent / "kvserve")
    argv = [kvserve, "serve", *MODES[mode], "--ray-address", args.ray_address, "--replica-num-cpus", "1",
            "--host", "0.0.0.0", "--port", str(PORT), "--uvicorn-log-level", "warning", *args.engine_flags]
    log = open(Path(args.log_dir) / f"{mode}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve {mode} exited {proc.returncode}; see {log.name}")
        try:
            view = httpx.get(url + "/v1/replicas", timeout=10).json()
            up = len(view["replicas"]) + len(view.get("prefill", {}).get("replicas", {}))
            if up == 2 and httpx.get(url + "/v1/models", timeout=10).status_code == 200:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvserve serve {mode} was not ready in 600 s; see {log.name}")
        time.sleep(1)
    for i in range(3):   # warm-up: both kinds of request through every replica
        httpx.post(url + "/v1/completions", json={"prompt": f"Warm-up {i}. " + args.warmup_text, "max_tokens": 4},
                   timeout=600).raise_for_status()
        httpx.post(url + "/v1/chat/completions", timeout=600,
                   json={"messages": [{"role": "user", "content": f"Warm-up {i}: hello"}], "max_tokens": 4}
                   ).raise_for_status()
    return proc


def run_mode(mode: str, args, url: str, questions, documents) -> Run:
    import signal
    t0 = time.perf_counter()
    print(f"[{mode}] starting ...", flush=True)
    proc = deploy(mode, args, url)
    start_s = time.perf_counter() - t0
    try:
        before = scrape(url)
        results, wall = asyncio.run(workload(url, args, questions, documents))
        after = scrape(url)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    keys = ("kvserve:kv_transfer_received_bytes_total", "kvserve:kv_transfer_receive_seconds_total",
            "kvserve:kv_transfer_received_requests_total", "kvserve:kv_transfer_received_blocks_total")
    transfer = {k: summed(after, k) - summed(before, k) for k in keys}
    return Run(mode, results, wall, start_s, transfer)


def row(run: Run) -> list[str]:
    chats = [r for r in run.results if r.kind == "chat" and r.ok]
    longs = [r for r in run.results if r.kind == "long" and r.ok]
    errors = sum(not r.ok for r in run.results)
    gaps = [g for r in chats for g in r.gaps]
    t = run.transfer
    n, moved, took = (t[f"kvserve:kv_transfer_{k}_total"] for k in ("received_requests", "received_bytes",
                                                                     "receive_seconds"))
    per_request = f"{moved / n / 2**20:.2f} / {1e3 * took / n:.1f}" if n else "—"
    rate = f"{moved / took / 2**20:.0f}" if took else "—"
    tokens = sum(r.tokens for r in run.results if r.ok)
    return [run.mode, f"{len(chats) + len(longs)} / {errors}",
            f"{fmt(percentile(gaps, 50), 1e3, 0)} / {fmt(percentile(gaps, 99), 1e3, 0)}",
            f"{fmt(percentile([r.ttft for r in chats], 50))} / {fmt(percentile([r.ttft for r in chats], 99))}",
            f"{fmt(percentile([r.ttft for r in longs], 50))} / {fmt(percentile([r.ttft for r in longs], 99))}",
            fmt(tokens / run.wall, digits=1), fmt(run.wall, digits=1),
            f"{moved / 2**20:.1f}" if n else "—", per_request, rate, fmt(run.start_s, digits=0)]


def report(args, runs: list[Run], long_lens: list[int], load_before: str, load_after: str) -> str:
    facts = machine_facts()
    return "\n".join([
        "Three network hosts on this VM (Linux network namespaces on a bridge, "
        "kvserve/distributed/netns.py): a 0-CPU Ray head in host 0 (the ingress and `kvserve serve`), a 1-CPU "
        "Ray worker node in hosts 1 and 2. Colocated: `kvserve serve --replicas 2`, one engine replica per "
        "worker host, prefix routing. Disaggregated: `kvserve serve --disaggregate 1:1`, the prefill "
        "replica on one worker host and the decode replica on the other, the prompt's KV blocks moved over "
        "the TCP KV connector (ZeroMQ, the pool's own bfloat16 format).",
        "",
        f"Workload: {args.chat_clients} clients sending {args.chats} streamed chats in turn (30-60-token "
        f"questions, {args.chat_tokens} output tokens), while {args.long} completions of "
        f"{min(long_lens)}-{max(long_lens)}-token prompts ({args.long_output} output tokens) arrive one every "
        f"{args.long_every:g} s; greedy, `ignore_eos`. Engine per replica: `{' '.join(args.engine_flags)}`. "
        "ITL: gaps between streamed chunks with text, chats only. KV moved: bytes the decode replica "
        "received over the run (its connector counters), per request (chats and long prompts alike) with "
        "the time to receive them, and the receive rate. Start: seconds to deploy and warm up.",
        "",
        f"Command: `{command_line()}`",
        "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items()) + ".",
        f"Load average (1/5/15 min) before / after: {load_before} -> {load_after}.",
        "",
        md_table(["mode", "done / errors", "chat ITL p50 / p99 (ms)", "chat TTFT p50 / p99 (s)",
                  "long-prompt TTFT p50 / p99 (s)", "output tokens/s", "wall (s)", "KV moved (MiB)",
                  "per request: MiB / receive ms", "receive MiB/s", "start (s)"], [row(r) for r in runs]),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=24)
    p.add_argument("--chat-clients", type=int, default=3)
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-every", type=float, default=4.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    p.add_argument("--ray-address", default=None, help=argparse.SUPPRESS)   # set by rerun_on_hosts
    args = p.parse_args(argv)
    if args.ray_address is None:
        if os.geteuid() != 0:
            p.error("network hosts need root (network namespaces)")
        return rerun_on_hosts(3)
    args.engine_flags = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
                         "--enforce-eager"]
    import tempfile

    from kvserve.engine.builder import load_tokenizer
    from kvserve.model.loader import resolve_model_path

    args.log_dir = tempfile.mkdtemp(prefix="kvserve-disagg-")
    tokenizer = load_tokenizer(resolve_model_path(None))
    ids = tokenizer.encode(prose_corpus(), add_special_tokens=False)
    rng = random.Random(args.seed)
    documents, long_lens = [], []
    for _ in range(args.long):
        n = rng.randint(int(args.long_tokens * 0.9), args.long_tokens)
        start = rng.randrange(len(ids) - n)
        documents.append(tokenizer.decode(ids[start:start + n]) + "\nSummary:")
        long_lens.append(n)
    questions = []
    for _ in range(args.chats):
        start = rng.randrange(len(ids) - 60)
        questions.append("Explain this: " + tokenizer.decode(ids[start:start + rng.randint(30, 60)]))
    args.warmup_text = tokenizer.decode(ids[-args.long_tokens:])
    host_ip = args.ray_address.split(":")[0]
    url = f"http://{host_ip}:{PORT}"
    load_before = load_average()
    runs = [run_mode(m.strip(), args, url, questions, documents) for m in args.modes.split(",") if m.strip()]
    text = report(args, runs, long_lens, load_before, load_average())
    print(text)
    if not args.no_write:
        replace_section(SECTION, text)
        print(f"\nwrote the '## {SECTION}' section of BENCHMARKS.md")
    return 0 if all(r.ok for run in runs for r in run.results) else 1


if __name__ == "__main__":
    sys.exit(main())
