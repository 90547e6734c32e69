"""Fuzz `kvserve serve` over HTTP for minutes: every body gets 200 or a 4xx and the engine survives.

    python benchmarks/fuzz_server.py                   # 5 minutes, table to BENCHMARKS.md
    python benchmarks/fuzz_server.py --minutes 1 --no-write

Starts the server on a free loopback port (bundled model, three tenant keys and an admin key),
then lets hypothesis generate completions and chat bodies around the OpenAI schema
(tests/fuzz_bodies.py: mostly valid fields, sometimes any JSON, edge floats, lone surrogates,
special-token text) until the time is up. After each case /health must answer 200. Then the
hostile cases of benchmarks/hostile_http.py run (a flood request, a token ceiling, a tenant at the
operator routes, slow and silent connections, the concurrency limit, a client leaving an n > 1
request, KV events on every interface), and what a flood of large requests from one key costs
another key's short requests (p50/p99 latency, alone and during the flood). At the end every KV
block must be free and SIGTERM must end the server with status 0. Prints and records cases tried,
statuses per route, the hostile cases, the flood's cost and survival.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_bodies  # noqa: E402
import hostile_http as hostile  # noqa: E402
import httpx  # noqa: E402
from common import command_line, md_table, replace_section  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from serve_load import ServerProcess, wait_idle  # noqa: E402

SECTION = "HTTP fuzz"
SERVER_ARGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--max-body-bytes", "65536",
               *hostile.SERVER_LIMITS]


class TimeUp(Exception):
    """The time budget is spent."""


def fuzz(url: str, seconds: float) -> tuple[Counter, list[str]]:
    """Post generated bodies until `seconds` pass; (status counts per route, problems found)."""
    counts: Counter = Counter()
    problems: list[str] = []
    deadline = time.monotonic() + seconds

    @settings(max_examples=10**6, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_bodies.CASES)
    def case(route_body):
        if time.monotonic() > deadline:
            raise TimeUp
        path, body = route_body
        r = httpx.post(url + path, content=json.dumps(fuzz_bodies.short(path, body)), timeout=120,
                       headers={"Content-Type": "application/json", **hostile.auth(hostile.FUZZ_KEY)})
        counts[(path.removeprefix("/v1/"), r.status_code)] += 1
        if r.status_code >= 500 or (r.status_code == 200 and '"error"' in r.text and body.get("stream")):
            problems.append(f"{r.status_code} for {json.dumps(body)[:200]}: {r.text[:200]}")
        if httpx.get(url + "/health", timeout=30).status_code != 200:
            problems.append(f"/health not 200 after {json.dumps(body)[:200]}")
            raise TimeUp

    try:
        case()
    except TimeUp:
        pass
    return counts, problems


def hostile_cases(server: ServerProcess) -> list[hostile.Row]:
    """Every hostile case, each followed by a /health check."""
    url, rows = server.url, []
    for run in (lambda: [hostile.case_flood(url)], lambda: [hostile.case_token_ceiling(url)],
                lambda: [hostile.case_tenant_at_operator_routes(url)], lambda: hostile.case_slow_connections(url),
                lambda: [hostile.case_leaving_n_request(url, server.log.name)],
                lambda: [hostile.case_remote_events()]):
        new = run()
        status = hostile.health(url)
        for row in new:
            row.health = status
        rows += new
    return rows


def hostile_report(rows: list[hostile.Row], cost: list[list[str]], flood: Counter) -> list[str]:
    """The hostile cases' and the flood cost's part of the section."""
    table = md_table(["case", "sent", "expected", "got", "/health after", "as expected"],
                     [[r.case, r.sent, r.expected, r.got, str(r.health), "yes" if r.ok and r.health == 200 else "**no**"]
                      for r in rows])
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(flood.items()))
    return ["", "Hostile cases (`benchmarks/hostile_http.py`; the server ran with `" + " ".join(hostile.SERVER_LIMITS)
            + "`):", "", table, "",
            f"What a flood costs another key: `{hostile.PROBE_KEY}` sends short completions "
            f"({hostile.PROBE['max_tokens']} tokens, one at a time) alone, then while `{hostile.FLOOD_KEY}` "
            f"streams large ones (its share: `--max-running-per-key {hostile.SHARE}` sequences in the engine, "
            f"up to `--max-queue {hostile.MAX_QUEUE}` more waiting in the server).", "",
            md_table(["probe requests", "requests", "p50 s", "p99 s", "statuses"], cost), "",
            f"- the flood's own answers during the probe: {answers} (waiting: held for its key's share)"]


def report(counts: Counter, problems: list[str], seconds: float, idle: dict, code: int,
           hostile_rows: list[hostile.Row], cost: list[list[str]], flood: Counter) -> str:
    """The markdown section."""
    routes = sorted({route for route, _ in counts})
    statuses = sorted({status for _, status in counts})
    rows = [[route] + [str(counts[(route, s)]) for s in statuses] + [str(sum(counts[(route, s)] for s in statuses))]
            for route in routes]
    free = idle["kvserve:num_blocks_free"] == idle["kvserve:num_blocks_total"]
    table = md_table(["route"] + [str(s) for s in statuses] + ["cases"], rows)
    held = all(r.ok and r.health == 200 for r in hostile_rows)
    survived = not problems and free and code == 0 and held and flood_ok(cost)
    lines = [f"`{command_line()}`: {sum(counts.values())} fuzzed bodies, then the hostile cases and the flood, "
             f"{seconds:.0f} s in all against `kvserve serve {' '.join(SERVER_ARGS)}`; hypothesis bodies from "
             "`tests/fuzz_bodies.py`.", "", table,
             *hostile_report(hostile_rows, cost, flood), "",
             f"- 5xx answers or error events to fuzzed bodies: {len(problems)}; /health 200 after every case: "
             f"{'yes' if not any('/health' in p for p in problems) else 'no'}; hostile cases held: "
             f"{sum(r.ok and r.health == 200 for r in hostile_rows)} of {len(hostile_rows)}",
             f"- KV blocks free afterwards: {'yes' if free else 'no'}; exit status after SIGTERM: {code}",
             f"- verdict: **{'survived' if survived else 'FAILED'}**"]
    lines += [f"  - {p}" for p in problems[:10]]
    return "\n".join(lines)


def flood_ok(cost: list[list[str]]) -> bool:
    """Every probe request was answered 200, alone and during the flood."""
    return all(row[4] == f"200: {row[1]}" for row in cost)


def main(argv: list[str] | None = None) -> int:
    """Run the fuzz and report; exit 1 when anything but 200 or 4xx came back."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    server = ServerProcess(SERVER_ARGS)
    start = time.perf_counter()
    try:
        counts, problems = fuzz(server.url, args.minutes * 60)
        rows = hostile_cases(server)
        cost, flood = hostile.flood_cost(server.url)
        idle = wait_idle(server.url, hostile.auth(hostile.ADMIN_KEY))
    finally:
        code = server.stop()
    section = report(counts, problems, time.perf_counter() - start, idle, code, rows, cost, flood)
    print(section)
    if not args.no_write:
        replace_section(SECTION, section)
    return 0 if "**survived**" in section else 1


if __name__ == "__main__":
    sys.exit(main())
