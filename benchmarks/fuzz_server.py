"""Fuzz `kvserve serve` over HTTP for minutes: every body gets 200 or a 4xx and the engine survives.

    python benchmarks/fuzz_server.py                   # 5 minutes, table to BENCHMARKS.md
    python benchmarks/fuzz_server.py --minutes 1 --no-write

Starts the server on a free loopback port (bundled model), then lets hypothesis generate
completions and chat bodies around the OpenAI schema (tests/fuzz_bodies.py: mostly valid
fields, sometimes any JSON, edge floats, lone surrogates, special-token text) until the time is
up. After each case /health must answer 200. At the end every KV block must be free and
SIGTERM must end the server with status 0. Prints and records cases tried, statuses per route
and survival.
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
import httpx  # noqa: E402
from common import command_line, md_table, replace_section  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from serve_load import ServerProcess, wait_idle  # noqa: E402

SECTION = "HTTP fuzz"
SERVER_ARGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--max-body-bytes", "65536"]


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
                       headers={"Content-Type": "application/json"})
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


def report(counts: Counter, problems: list[str], seconds: float, idle: dict, code: int) -> str:
    """The markdown section."""
    routes = sorted({route for route, _ in counts})
    statuses = sorted({status for _, status in counts})
    rows = [[route] + [str(counts[(route, s)]) for s in statuses] + [str(sum(counts[(route, s)] for s in statuses))]
            for route in routes]
    free = idle["kvserve:num_blocks_free"] == idle["kvserve:num_blocks_total"]
    table = md_table(["route"] + [str(s) for s in statuses] + ["cases"], rows)
    verdict = "survived" if not problems and free and code == 0 else "FAILED"
    lines = [f"`{command_line()}`: {sum(counts.values())} cases in {seconds:.0f} s against `kvserve serve "
             f"{' '.join(SERVER_ARGS)}`; hypothesis bodies from `tests/fuzz_bodies.py`.", "", table, "",
             f"- 5xx answers or error events: {len(problems)}; /health 200 after every case: "
             f"{'yes' if not any('/health' in p for p in problems) else 'no'}",
             f"- KV blocks free afterwards: {'yes' if free else 'no'}; exit status after SIGTERM: {code}",
             f"- verdict: **{verdict}**"]
    lines += [f"  - {p}" for p in problems[:10]]
    return "\n".join(lines)


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
        idle = wait_idle(server.url, {})
    finally:
        code = server.stop()
    section = report(counts, problems, time.perf_counter() - start, idle, code)
    print(section)
    if not args.no_write:
        replace_section(SECTION, section)
    return 0 if "**survived**" in section else 1


if __name__ == "__main__":
    sys.exit(main())
