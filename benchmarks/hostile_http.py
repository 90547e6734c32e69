"""Hostile HTTP cases for benchmarks/fuzz_server.py (issue 33): a flood request, a token ceiling, a
tenant at the operator routes, slow and silent connections, the concurrency limit, a client that
leaves an n > 1 request, a KV events bind on every interface; and what a flood costs other clients.

Each case returns a row: what was sent, what the server must answer, what it answered, /health
after it, and whether that held. Raw sockets stand in for clients that never finish a request.
"""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
from common import REPO_ROOT, percentile

FUZZ_KEY, FLOOD_KEY, PROBE_KEY, ADMIN_KEY = "fuzz-key", "flood-key", "probe-key", "admin-key"
HEADER_TIMEOUT = BODY_TIMEOUT = 2.0
MAX_CONCURRENT = 256
SHARE = 16                     # --max-running-per-key
MAX_QUEUE = 512
SERVER_LIMITS = ["--api-key", FUZZ_KEY, "--api-key", FLOOD_KEY, "--api-key", PROBE_KEY,
                 "--admin-api-key", ADMIN_KEY, "--cache-isolation", "api-key", "--max-queue", str(MAX_QUEUE),
                 "--max-running-per-key", str(SHARE), "--max-concurrent-requests", str(MAX_CONCURRENT),
                 "--request-header-timeout", str(HEADER_TIMEOUT), "--request-body-timeout", str(BODY_TIMEOUT)]
FLOOD = {"prompt": [[1, 2, 3]] * 200, "n": 128, "max_tokens": 200}
FLOOD_STREAM = {"prompt": "Once upon a time", "n": 8, "max_tokens": 256, "ignore_eos": True, "stream": True}
PROBE = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


@dataclass
class Row:
    case: str
    sent: str
    expected: str
    got: str
    ok: bool
    health: int = 0



def _recv(sock) -> bytes | None:
    """What a ready socket has (b"" once it is closed or broken), or None when nothing is there yet."""
    try:
        return sock.recv(65536)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""

def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=30).status_code
    except httpx.HTTPError:
        return 0


def _post(url: str, body: dict, key: str = FUZZ_KEY, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=auth(key), timeout=timeout)


def _error(r: httpx.Response) -> dict:
    try:
        return r.json().get("error") or {}
    except ValueError:
        return {}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _connect(url: str, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(url)), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def _request_bytes(path: str, body: dict, key: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


# ---- one request, one answer ---------------------------------------------------------------------


def case_flood(url: str) -> Row:
    r = _post(url, FLOOD)
    msg = _error(r).get("message", "")
    return Row("flood request", "200 prompts x n=128 x max_tokens 200 (25,600 sequences)",
               "400 naming --max-queue", f"{r.status_code} ({_error(r).get('param')})",
               r.status_code == 400 and "--max-queue" in msg)


def case_token_ceiling(url: str) -> Row:
    body = {"prompt": [[1, 2, 3]] * 4, "n": 128, "max_tokens": 2000}
    r = _post(url, body)
    return Row("token ceiling", "4 prompts x n=128 x max_tokens 2000 (512 sequences, within --max-queue)",
               "400 request_tokens_exceeded", f"{r.status_code} {_error(r).get('code')}",
               r.status_code == 400 and _error(r).get("code") == "request_tokens_exceeded")


def case_tenant_at_operator_routes(url: str) -> Row:
    codes = {}
    for path in ("/metrics", "/v1/kv/state"):
        for who, key in (("tenant", PROBE_KEY), ("admin", ADMIN_KEY)):
            codes[f"{path} {who}"] = httpx.get(url + path, headers=auth(key), timeout=60).status_code
    got = ", ".join(f"{k} {v}" for k, v in codes.items())
    ok = all(v == (403 if k.endswith("tenant") else 200) for k, v in codes.items())
    return Row("tenant key at the operator routes", "GET /metrics and /v1/kv/state with a tenant key, then the "
               "admin key", "403, then 200", got, ok)


def case_leaving_n_request(url: str, log_path: str) -> Row:
    body = {**PROBE, "n": 4, "max_tokens": 400, "ignore_eos": True}
    try:
        _post(url, body, timeout=1.0)
        got = "answered before the client left"
    except httpx.TimeoutException:
        got = "client left after 1 s"
    time.sleep(1.0)
    logged = open(log_path).read().count("never retrieved")
    return Row("client leaves an n=4 request", "non-streamed, 400 tokens each, read timeout 1 s",
               "aborted, nothing logged", f"{got}; 'never retrieved' in the log: {logged}", logged == 0)


def case_remote_events() -> Row:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", "1", "--kv-events", "tcp://*:5557"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    named = "--kv-events-allow-remote" in proc.stderr + proc.stdout
    return Row("KV events on every interface", "kvserve serve --kv-events tcp://*:5557",
               "refused at start-up, naming --kv-events-allow-remote", f"exit status {proc.returncode}",
               proc.returncode != 0 and named)


# ---- connections that never finish ---------------------------------------------------------------


def case_slow_connections(url: str, bare: int = 2000, heads: int = 200, bodies: int = 300) -> list[Row]:
    """`bare` silent connections, `heads` with half a request line and headers, `bodies` with whole
    headers and half a body (each an HTTP request in flight: past --max-concurrent-requests the next
    request gets 503); every one must be answered 408 and closed near its deadline."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"
    body = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + FUZZ_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    t0 = time.monotonic()
    groups = {"silent": [_connect(url) for _ in range(bare)],
              "partial headers": [_connect(url, head) for _ in range(heads)],
              "partial body": [_connect(url, body) for _ in range(bodies)]}
    time.sleep(0.3)                        # the bodies' requests reach the app
    h0 = time.monotonic()
    during = health(url)
    health_s = time.monotonic() - h0
    over = _post(url, PROBE)
    closed = _wait_closed(groups, deadline=t0 + 4 * max(HEADER_TIMEOUT, BODY_TIMEOUT) + 10)
    rows = []
    for name, socks in groups.items():
        answers = closed[name]
        statuses = Counter(a.split(b" ")[1].decode() if a.startswith(b"HTTP/1.1 ") else "none" for a, _ in answers)
        slowest = max((t - t0 for _, t in answers), default=float("nan"))
        allowed = {"408", "503"} if name == "partial body" else {"408"}   # past the concurrency limit: 503
        got = ", ".join(f"{v} x {k}" for k, v in sorted(statuses.items()))
        rows.append(Row(f"{len(socks)} {name} connections", "opened at once, never finished",
                        " or ".join(sorted(allowed)) + ", and closed", f"{got}; last closed {slowest:.1f} s after "
                        "opening", len(answers) == len(socks) and set(statuses) <= allowed))
    for socks in groups.values():
        for s in socks:
            s.close()
    rows.append(Row("/health among them", f"GET /health with {bare + heads + bodies} such connections open",
                    "200", f"{during} in {health_s:.2f} s", during == 200))
    rows.append(Row("concurrency limit", f"a completion while {bodies} requests read their bodies "
                    f"(--max-concurrent-requests {MAX_CONCURRENT})", "503 too_many_concurrent_requests",
                    f"{over.status_code} {_error(over).get('code')}",
                    over.status_code == 503 and _error(over).get("code") == "too_many_concurrent_requests"))
    return rows


def _wait_closed(groups: dict[str, list[socket.socket]], deadline: float) -> dict[str, list[tuple[bytes, float]]]:
    """Read every socket to EOF; per group, (what came back, when it closed)."""
    sel = selectors.DefaultSelector()
    data: dict[socket.socket, bytes] = {}
    for name, socks in groups.items():
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, name)
            data[s] = b""
    closed: dict[str, list[tuple[bytes, float]]] = {name: [] for name in groups}
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            chunk = _recv(key.fileobj)
            if chunk is None:
                continue
            if chunk:
                data[key.fileobj] += chunk
            else:
                sel.unregister(key.fileobj)
                closed[key.data].append((data[key.fileobj], time.monotonic()))
    sel.close()
    return closed


# ---- what a flood costs the others -----------------------------------------------------------------


def probe(url: str, count: int) -> tuple[list[float], Counter]:
    """`count` short completions one after another with the probe key: their latencies and statuses."""
    latencies, statuses = [], Counter()
    for _ in range(count):
        t0 = time.perf_counter()
        r = _post(url, PROBE, key=PROBE_KEY)
        latencies.append(time.perf_counter() - t0)
        statuses[r.status_code] += 1
    return latencies, statuses


class Flood:
    """`count` streamed requests of the flood key on raw sockets, read (and dropped) on a thread until
    `stop()`, which closes them (the flooder leaves: its requests are aborted)."""

    def __init__(self, url: str, count: int):
        self.socks = [_connect(url, _request_bytes("/v1/completions", FLOOD_STREAM, FLOOD_KEY)) for _ in range(count)]
        self.first: dict[socket.socket, bytes] = {s: b"" for s in self.socks}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self.socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        while not self._stop.is_set() and sel.get_map():
            for key, _ in sel.select(timeout=0.2):
                chunk = _recv(key.fileobj)
                if chunk is None:
                    continue
                if len(self.first[key.fileobj]) < 16:
                    self.first[key.fileobj] += chunk[:16]
                if not chunk:
                    sel.unregister(key.fileobj)
        sel.close()

    def statuses(self) -> Counter:
        """Status of each flood request so far ('waiting': no answer yet, held for its key's share)."""
        out = Counter()
        for head in self.first.values():
            out[head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "waiting"] += 1
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def flood_cost(url: str, probes: int = 20, flood_requests: int = 80) -> tuple[list[list[str]], Counter]:
    """Probe latencies alone and while the flood key streams `flood_requests` large requests;
    (table rows, the flood's own statuses)."""
    rows = []
    alone, st_alone = probe(url, probes)
    rows.append(_cost_row("alone", alone, st_alone))
    flood = Flood(url, flood_requests)
    try:
        time.sleep(3.0)                    # the flood's share runs, the rest waits or is refused
        during, st_during = probe(url, probes)
        flood_statuses = flood.statuses()
    finally:
        flood.stop()
    what = (f"while `{FLOOD_KEY}` holds {flood_requests} streamed requests of n={FLOOD_STREAM['n']} x "
            f"{FLOOD_STREAM['max_tokens']} tokens")
    rows.append(_cost_row(what, during, st_during))
    return rows, flood_statuses


def _cost_row(what: str, latencies: list[float], statuses: Counter) -> list[str]:
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    return [what, str(len(latencies)), f"{percentile(latencies, 50):.2f}", f"{percentile(latencies, 99):.2f}", answers]
