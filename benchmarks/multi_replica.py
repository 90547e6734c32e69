"""Replicas and routing: a multi-tenant workload on `kvserve serve --replicas 2`, once per routing policy.

    python benchmarks/multi_replica.py              # 8 tenants, 64 requests, 8 clients, 16 tokens; table to BENCHMARKS.md
    python benchmarks/multi_replica.py --requests 12 --clients 4 --tenants 2 --max-tokens 4 --no-write   # smoke run
    python benchmarks/multi_replica.py --hosts     # across network hosts (root): "Multiple replicas across hosts"

The workload: `--tenants` long system prompts (400-600 tokens each, cut seeded from CPython's
`pydoc_data.topics` prose with the bundled model's tokenizer), each request one tenant's system
prompt (tenant drawn seeded) followed by a short user question (20-40 tokens of other prose),
sent to `/v1/chat/completions` by `--clients` concurrent streaming clients, `--max-tokens` output
tokens each (greedy, `ignore_eos`). The same requests run once per policy (`--policies`), each
on a freshly deployed application (the Ray Serve app of `kvserve serve --replicas`, built with
`server/replicas.py`'s `build_application`; one local Ray, `num_cpus=2`, no dashboard, replicas
asking for no CPUs), so every policy starts with empty prefix caches. Each replica gets one
short and one long warm-up request (pinned with `x-kvserve-replica`, unrelated text), then one short
routed chat request per replica, before the timed run.

Measured per policy: prefix-cache hit rate (prompt tokens served from the cache / prompt tokens,
from each response's usage `prompt_tokens_details.cached_tokens`, checked against the replicas'
`kvserve:prefix_cache_hits_total` in the joined /metrics), TTFT p50/p99 (client-side: time to
the first chunk with text), output tokens/s (usage counts / wall time of the run), and requests
per replica (the `x-kvserve-replica` response header).

With `--hosts` the script makes three network hosts (kvserve/distributed/netns.py: a 0-CPU Ray
head in host 0, a 1-CPU Ray worker node in hosts 1 and 2) and runs itself again inside host 0,
joining that Ray cluster: each replica asks for one CPU, so each runs on a worker host of its own,
and the router in host 0 follows their KV events over the hosts' network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
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
from tqdm import tqdm  # noqa: E402

SECTION = "Multiple replicas"
POLICIES = ("prefix", "round-robin", "least-loaded")
TARGET_HIT_RATIO = 1.8  # issue 15: prefix routing's hit rate >= 1.8x round-robin's, and a lower TTFT p50
REPLICA_HEADER = "x-kvserve-replica"


@dataclass
class Job:
    """One request: a tenant's system prompt and a short question."""

    tenant: int
    system: str
    question: str


@dataclass
class Result:
    """What one request measured."""

    ok: bool
    error: str | None = None
    replica: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class PolicyRun:
    """One policy's run: results, wall time, the replicas' metric deltas."""

    policy: str
    results: list[Result]
    wall: float
    start_s: float
    metric_hits: float = 0.0
    metric_queries: float = 0.0
    pool_tokens: dict[str, int] = field(default_factory=dict)
    preemptions: float = 0.0


def make_jobs(tokenizer, requests: int, tenants: int, seed: int, system_tokens: tuple[int, int],
              question_tokens: tuple[int, int]) -> tuple[list[str], list[Job]]:
    """Seeded: `tenants` system prompts, then `requests` (tenant, question) pairs."""
    rng = random.Random(seed)
    ids = tokenizer.encode(prose_corpus(), add_special_tokens=False)
    # tenants' system prompts from the first half of the corpus, questions from the second half
    half = len(ids) // 2

    def cut(lo: int, hi: int, n: int) -> str:
        start = rng.randrange(lo, hi - n)
        return tokenizer.decode(ids[start:start + n]).strip()

    systems = [cut(0, half, rng.randint(*system_tokens)) for _ in range(tenants)]
    jobs = []
    for _ in range(requests):
        t = rng.randrange(tenants)
        jobs.append(Job(t, systems[t], cut(half, len(ids), rng.randint(*question_tokens))))
    return systems, jobs


def request_body(job: Job, max_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": job.system},
                         {"role": "user", "content": "Question: " + job.question}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def run_one(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> Result:
    """One streamed chat request, timed."""
    res = Result(ok=False)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            res.replica = r.headers.get(REPLICA_HEADER)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line[6:] == "[DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.prompt_tokens, res.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for ch in chunk.get("choices", []):
                    if ch.get("delta", {}).get("content") and res.ttft is None:
                        res.ttft = time.perf_counter() - t0
            res.e2e = time.perf_counter() - t0
            res.ok = done and res.completion_tokens > 0
            if not res.ok:
                res.error = "stream ended without [DONE] or usage"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(url: str, jobs: list[Job], clients: int, max_tokens: int, timeout: float,
                   desc: str) -> tuple[list[Result], float]:
    """`clients` workers take the jobs in order; a tqdm bar counts finished requests."""
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: list[Result] = []
    bar = tqdm(total=len(jobs), desc=desc, unit="req")

    async def worker(client: httpx.AsyncClient):
        while True:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await run_one(client, url, request_body(job, max_tokens), timeout))
            bar.update(1)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.perf_counter() - start
    bar.close()
    return results, wall


def scrape(url: str) -> dict[str, float]:
    """kvserve:* samples of the joined /metrics, keyed by name and labels (model_name left out)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for s in family.samples:
            labels = "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + labels] = s.value
    return out


def summed(metrics: dict[str, float], name: str) -> float:
    """A metric summed over the replicas."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "["))


def per_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    prefix = name + "[replica="
    return {k[len(prefix):-1]: v for k, v in metrics.items() if k.startswith(prefix) and k.count("[") == 1}


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """The joined /metrics once no replica runs or queues a request (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = summed(m, "kvserve:num_requests_running") + summed(m, "kvserve:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def run_policy(policy: str, args, engine: dict, jobs: list[Job], url: str) -> PolicyRun:
    """Deploy a fresh application with `policy`, warm each replica, run the jobs, delete it."""
    from ray import serve

    from kvserve.server.replicas import build_application

    t0 = time.perf_counter()
    where = ({"num_cpus": 1, "ingress_node": args.host} if args.ray_address else {"events_host": "127.0.0.1"})
    app = build_application(engine, {}, replicas=args.replicas, routing=policy, **where)
    print(f"[{policy}] starting {args.replicas} replicas ...", flush=True)
    serve.run(app, name="kvserve", route_prefix="/")
    names = sorted(httpx.get(url + "/v1/replicas", timeout=60).json()["replicas"])
    for name in names:  # warm-up: each engine's first short and long forward passes, outside the timed run
        for prompt in ("Warm-up: one two three", args.warmup_text):
            r = httpx.post(url + "/v1/completions", headers={REPLICA_HEADER: name}, timeout=args.request_timeout,
                           json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            r.raise_for_status()
    for i in range(len(names)):  # and the routed chat path (the ingress's chat template, the router's pick)
        r = httpx.post(url + "/v1/chat/completions", timeout=args.request_timeout,
                       json={"messages": [{"role": "user", "content": f"Warm-up {i}: say hello."}],
                             "max_tokens": 2, "temperature": 0})
        r.raise_for_status()
    start_s = time.perf_counter() - t0
    before = wait_idle(url)
    results, wall = asyncio.run(run_load(url, jobs, args.clients, args.max_tokens, args.request_timeout,
                                         desc=policy))
    after = wait_idle(url)
    run = PolicyRun(policy, results, wall, start_s)
    for key in ("hits", "queries"):
        name = f"kvserve:prefix_cache_{key}_total"
        setattr(run, f"metric_{key}", summed(after, name) - summed(before, name))
    run.preemptions = summed(after, "kvserve:num_preemptions_total") - summed(before, "kvserve:num_preemptions_total")
    run.pool_tokens = {k: int(v) * args.block_size
                       for k, v in per_replica(after, "kvserve:num_blocks_total").items()}
    serve.delete("kvserve")  # the replicas (and their caches) go; the next policy starts fresh
    return run


@dataclass
class Summary:
    policy: str
    ok: int
    errors: int
    hit_rate: float
    metric_hit_rate: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tokens_per_s: float
    wall: float
    per_replica: list[int]
    first_error: str | None


def summarize(run: PolicyRun) -> Summary:
    ok = [r for r in run.results if r.ok]
    errors = [r for r in run.results if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    counts: dict[str, int] = {}
    for r in ok:
        counts[r.replica or "?"] = counts.get(r.replica or "?", 0) + 1
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return Summary(run.policy, len(ok), len(errors), sum(r.cached_tokens for r in ok) / max(prompt, 1),
                   run.metric_hits / run.metric_queries if run.metric_queries else None,
                   percentile(ttft, 50), percentile(ttft, 99),
                   sum(r.completion_tokens for r in ok) / run.wall, run.wall,
                   sorted(counts.values(), reverse=True), errors[0].error if errors else None)


def verdict(summaries: dict[str, Summary]) -> str:
    """The issue's target, judged from the measured numbers."""
    target = (f"Issue 15's target (prefix routing's hit rate >= {TARGET_HIT_RATIO}x round-robin's, "
              "and its TTFT p50 below round-robin's)")
    p, rr = summaries.get("prefix"), summaries.get("round-robin")
    if p is None or rr is None:
        return f"{target}: not evaluated (this run measured {', '.join(summaries)})."
    ratio = p.hit_rate / rr.hit_rate if rr.hit_rate > 0 else float("inf")
    hit_ok = ratio >= TARGET_HIT_RATIO
    ttft_ok = p.ttft_p50 is not None and rr.ttft_p50 is not None and p.ttft_p50 < rr.ttft_p50
    clean = p.errors == 0 and rr.errors == 0
    met = hit_ok and ttft_ok and clean
    ratio_text = "inf" if ratio == float("inf") else f"{ratio:.2f}x"
    return (f"{target}: **{'met' if met else 'not met'}** (hit rate {100 * p.hit_rate:.1f} % vs "
            f"{100 * rr.hit_rate:.1f} %: {ratio_text}, {'met' if hit_ok else 'not met'}; TTFT p50 "
            f"{fmt(p.ttft_p50, 1e3, 0)} ms vs {fmt(rr.ttft_p50, 1e3, 0)} ms: {'met' if ttft_ok else 'not met'}"
            f"{'' if clean else '; errors in the run'}).")


def report(args, jobs: list[Job], runs: list[PolicyRun], system_lens: list[int], load_before: str,
           load_after: str) -> str:
    summaries = {run.policy: summarize(run) for run in runs}
    rows = []
    for run in runs:
        s = summaries[run.policy]
        rows.append([f"`{s.policy}`", f"{s.ok} / {s.errors}", fmt(100 * s.hit_rate, digits=1),
                     fmt(None if s.metric_hit_rate is None else 100 * s.metric_hit_rate, digits=1),
                     f"{fmt(s.ttft_p50, 1e3, 0)} / {fmt(s.ttft_p99, 1e3, 0)}", fmt(s.tokens_per_s, digits=1),
                     fmt(s.wall, digits=1), " / ".join(map(str, s.per_replica)), str(int(run.preemptions)),
                     fmt(run.start_s, digits=0)])
    facts = machine_facts()
    pools = sorted({t for run in runs for t in run.pool_tokens.values()})
    counts = [sum(1 for j in jobs if j.tenant == t) for t in range(args.tenants)]
    place = ("across network hosts (a 0-CPU Ray head with the ingress in one network namespace, a 1-CPU Ray "
             "worker node per replica in others; kvserve/distributed/netns.py)" if args.ray_address
             else "on one machine")
    ray_setup = ("that Ray cluster, each replica asking for 1 CPU" if args.ray_address
                 else "one local Ray, `num_cpus=2`, no dashboard")
    body = [
        f"`--replicas {args.replicas}` {place}: a multi-tenant chat workload routed by each policy in turn. "
        f"{args.tenants} tenants, each a system prompt of {min(system_lens)}-{max(system_lens)} tokens "
        f"({sum(system_lens)} in all; cut seeded, seed {args.seed}, from CPython's `pydoc_data.topics` prose), "
        f"{args.requests} requests (tenant drawn seeded: {min(counts)}-{max(counts)} requests per tenant), "
        f"each the tenant's system prompt and a {args.question_tokens[0]}-{args.question_tokens[1]}-token "
        f"question, sent to `/v1/chat/completions` by {args.clients} concurrent streaming clients; "
        f"{args.max_tokens} output tokens each (greedy, `ignore_eos`). Each policy runs on a freshly deployed "
        f"application (empty prefix caches; `build_application` of `server/replicas.py` on {ray_setup}), "
        "after warm-up requests of unrelated text (a short and a "
        f"{args.system_tokens[1]}-token one pinned to each replica, then as many short routed chat requests "
        "as replicas); policies run in the order given. "
        f"Engine per replica: `{' '.join(args.engine_flags)}`; each replica's KV pool holds "
        f"{'/'.join(map(str, pools)) or '?'} tokens.",
        "",
        "Hit rate: prompt tokens served from the prefix cache / prompt tokens, from each response's "
        "usage `cached_tokens`; the metrics column is the replicas' `kvserve:prefix_cache_hits_total` / "
        "`prefix_cache_queries_total` (joined `/metrics`, summed over replicas). TTFT: client-side, to "
        "the first chunk with text. Output tokens/s: usage counts / the run's wall time. Requests per "
        "replica: from the `x-kvserve-replica` header, busiest first. Start: seconds to deploy the "
        "replicas and warm them up (not in the timed run).",
        "",
        f"Command: `{command_line()}`",
        "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items()) + ".",
        f"Load average (1/5/15 min) before / after: {load_before} -> {load_after}.",
        "",
        md_table(["routing", "done / errors", "hit rate (%)", "hit rate, metrics (%)", "TTFT p50 / p99 (ms)",
                  "output tokens/s", "wall (s)", "requests per replica", "preemptions", "start (s)"], rows),
        "",
        verdict(summaries),
    ]
    errors = [s.first_error for s in summaries.values() if s.first_error]
    if errors:
        body += ["", "First errors: " + "; ".join(errors[:3])]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--system-tokens", default="400,600", help="min,max tokens of a tenant's system prompt")
    p.add_argument("--question-tokens", default="20,40", help="min,max tokens of a question")
    p.add_argument("--kv-cache-memory", default="128MiB",
                   help="per replica (float32 KV: 128MiB holds 2912 tokens of the bundled model, about "
                        "two thirds of the 8 default tenants' system prompts)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16, help="the engine's KV block size (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    p.add_argument("--hosts", action="store_true", help="run across three network hosts (needs root)")
    p.add_argument("--ray-address", default=None, help=argparse.SUPPRESS)   # set by rerun_on_hosts
    args = p.parse_args(argv)
    if args.hosts and args.ray_address is None:
        return rerun_on_hosts(1 + args.replicas)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if bad := [x for x in policies if x not in POLICIES]:
        p.error(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    args.system_tokens = tuple(int(x) for x in args.system_tokens.split(","))
    args.question_tokens = tuple(int(x) for x in args.question_tokens.split(","))
    engine = {"kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len,
              "block_size": args.block_size}
    args.engine_flags = [f"--kv-cache-memory {args.kv_cache_memory}", f"--max-model-len {args.max_model_len}",
                         f"--block-size {args.block_size}"]

    import ray
    from ray import serve

    from kvserve.engine.builder import load_tokenizer
    from kvserve.model.loader import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    systems, jobs = make_jobs(tokenizer, args.requests, args.tenants, args.seed, args.system_tokens,
                              args.question_tokens)
    system_lens = [len(tokenizer.encode(s, add_special_tokens=False)) for s in systems]
    corpus_ids = tokenizer.encode(prose_corpus(), add_special_tokens=False)
    args.warmup_text = tokenizer.decode(corpus_ids[-args.system_tokens[1]:])  # as long as the longest tenant
    load_before = load_average()
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    args.host = ray.util.get_node_ip_address() if args.ray_address else "127.0.0.1"
    try:
        with socket.socket() as s:
            s.bind((args.host, 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": args.host, "port": port})
        url = f"http://{args.host}:{port}"
        runs = [run_policy(policy, args, engine, jobs, url) for policy in policies]
    finally:
        serve.shutdown()
        ray.shutdown()
    text = report(args, jobs, runs, system_lens, load_before, load_average())
    print(text)
    if not args.no_write:
        section = SECTION + (" across hosts" if args.ray_address else "")
        replace_section(section, text)
        print(f"\nwrote the '## {section}' section of BENCHMARKS.md")
    return 0 if all(summarize(r).errors == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
