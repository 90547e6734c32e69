"""The KV state routes (/v1/kv/state, /v1/kv/stream), the --record file and `kvserve top`, against the
engine's own numbers under a real workload (one in-process server on the session model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from test_server_hardening import serving

from kvserve.server.app import build_app

KEY = "kv-state-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
COUNTED = ("num_blocks_total", "num_blocks_free", "num_blocks_cached_free", "num_blocks_used", "num_steps",
           "num_requests_running", "num_requests_waiting")
PREFIX = ("A paged KV cache splits every sequence into blocks of sixteen tokens, so that requests "
          "with the same beginning can share the blocks that hold it. ") * 3


@pytest.fixture(scope="module")
def served(llm, tmp_path_factory):
    record = tmp_path_factory.mktemp("kv-state") / "state.jsonl"
    llm.engine.reset_prefix_cache()
    app = build_app(llm.engine, api_key=KEY, record=str(record))
    with serving(app) as url:
        yield SimpleNamespace(url=url, app=app, record=record, engine=llm.engine)


def state(url: str) -> dict:
    r = httpx.get(f"{url}/v1/kv/state", headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def start_load(url: str, prompts: list[str], max_tokens: int, n: int = 1) -> list[threading.Thread]:
    """One completion request per prompt, each on its own thread (joined by the caller)."""
    def post(prompt):
        body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=180)
        assert r.status_code == 200, r.text
    threads = [threading.Thread(target=post, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def paired(served, monkeypatch) -> tuple[dict, dict]:
    """GET /v1/kv/state, and engine.get_metrics() taken in the same engine-thread call as its snapshot."""
    tracker = served.app.state.kv_hub.tracker
    real = type(tracker).snapshot
    def snapshot(engine):
        m = engine.get_metrics()
        return {**real(tracker, engine), "test_metrics": {k: m[k] for k in COUNTED}}
    monkeypatch.setattr(tracker, "snapshot", snapshot)
    s = state(served.url)
    return s, s["test_metrics"]


def check_counts(s: dict, m: dict) -> None:
    """Blocks counted by state equal get_metrics(); every block's letter agrees with its ref count."""
    pool, c = s["pool"], s["pool"]["counts"]
    assert len(pool["state"]) == m["num_blocks_total"] == s["kv"]["num_usable"]
    assert c["f"] + c["c"] == m["num_blocks_free"]
    assert c["c"] == m["num_blocks_cached_free"]
    assert c["u"] + c["s"] == m["num_blocks_used"]
    assert len(s["requests"]) == m["num_requests_running"] + m["num_requests_waiting"]
    for b, (letter, ref) in enumerate(zip(pool["state"], pool["ref"])):
        hashed = pool["hash"][16 * b:16 * b + 16] != "0" * 16
        assert letter == ("s" if ref > 1 else "u" if ref == 1 else "c" if hashed else "f")
    for b, holders in pool["holders"].items():
        assert len(holders) == pool["ref"][int(b)]  # every reference is a request's block table
        for i in holders:
            assert int(b) in s["requests"][i]["blocks"][0]


def test_state_needs_the_key_and_the_page_does_not(served):
    assert httpx.get(f"{served.url}/v1/kv/state").status_code == 401
    with httpx.stream("GET", f"{served.url}/v1/kv/stream") as r:
        assert r.status_code == 401
    page = httpx.get(f"{served.url}/dashboard")
    assert page.status_code == 200 and 'id="blockmap"' in page.text
    assert httpx.get(f"{served.url}/dashboard/static/dashboard.js").status_code == 200
    assert httpx.get(f"{served.url}/dashboard-data").status_code == 401  # only the page itself is open
    s = state(served.url)
    assert s["kv"]["bytes_per_token"] == served.engine.kv_bytes_per_token
    assert s["kv"]["format"] == served.engine.kv_format.description
    assert s["kv"]["block_size"] == 16 and s["requests"] == []


def test_counts_match_the_engine_under_load_and_a_shared_prefix_is_shared(served, monkeypatch):
    for t in start_load(served.url, [PREFIX + "Warm."], 2):  # the prefix is cached before the load
        t.join()
    threads = start_load(served.url, [PREFIX + f"Question {i}:" for i in range(4)], 16)
    events = stream_events(served.url, 4)  # the stream, meanwhile
    shared = []
    for _ in range(20):
        s, m = paired(served, monkeypatch)
        assert s["step"] == m["num_steps"]
        check_counts(s, m)
        shared = [b for b, ref in enumerate(s["pool"]["ref"]) if ref > 1]
        if len(shared) >= 4 and len(s["requests"]) >= 3:
            break
    for t in threads:
        t.join()
    assert len(shared) >= 4, "the prefix blocks were never shared by the running requests"
    holders = {s["requests"][i]["id"] for i in s["pool"]["holders"][str(shared[0])]}
    assert len(holders) == s["pool"]["ref"][shared[0]] >= 2
    assert any(r["prefix_hit_tokens"] >= 64 for r in s["requests"])
    check_stream(events)


def stream_events(url: str, count: int) -> list:
    """Starts reading /v1/kv/stream on a thread; the list fills with (arrival time, snapshot)."""
    events: list = []

    def read():
        with httpx.stream("GET", f"{url}/v1/kv/stream", headers=HEADERS, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), json.loads(line[6:])))
                    if len(events) >= count:
                        return
    threading.Thread(target=read, daemon=True).start()
    return events


def check_stream(events: list) -> None:
    deadline = time.monotonic() + 30
    while len(events) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(events) >= 4
    assert "history" in events[0][1]
    later = [snap for _, snap in events[1:]]
    for a, b in zip(later, later[1:]):
        assert b["time"] - a["time"] >= 0.24  # at most one snapshot every 250 ms
        assert b["step"] > a["step"] or b["requests"] != a["requests"] or b["pool"] != a["pool"]


def test_after_the_load_every_block_is_free(served):
    s = state(served.url)
    c = s["pool"]["counts"]
    assert s["requests"] == [] and c["u"] == c["s"] == 0
    assert c["f"] + c["c"] == len(s["pool"]["state"]) and c["c"] > 0
    a = s["analyzer"]
    assert 0 < a["kv_rows_computed"] < a["kv_rows_no_cache"] and 0 < a["saving"] < 1
    assert a["kv_rows_computed"] <= a["kv_rows_cache_formula"]  # prefix hits skipped rows
    assert len(s["history"]) >= 2 and s["history"][-1]["generation_tokens"] > s["history"][0]["generation_tokens"]


def test_the_record_file_holds_the_stream(served):
    lines = [json.loads(x) for x in served.record.read_text().splitlines()]
    assert len(lines) >= 4
    assert all(len(x["pool"]["state"]) == len(lines[0]["pool"]["state"]) for x in lines)
    assert [x["time"] for x in lines] == sorted(x["time"] for x in lines)
    assert any(x["pool"]["counts"]["s"] > 0 for x in lines)


def test_the_flags_reach_the_commands():
    from kvserve.cli import build_parser
    assert build_parser().parse_args(["serve", "--record", "run.jsonl"]).record == "run.jsonl"
    args = build_parser().parse_args(["top", "--url", "http://h:1", "--api-key", "k"])
    assert (args.url, args.api_key) == ("http://h:1", "k")


def test_top_shows_the_block_counts_under_tmux(served):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (apt-get install -y tmux)")
    session = f"kvserve-top-{int(time.time() * 1000)}"
    cmd = f"{sys.executable} -m kvserve.cli top --url {served.url} --api-key {KEY} --interval 0.3"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", cmd], check=True)
    try:
        idle = state(served.url)["pool"]["counts"]
        screen = wait_screen(session, "blocks total")
        total = len(state(served.url)["pool"]["state"])
        assert f"total {total}  free {idle['f']}  cached {idle['c']}  used 0  shared 0" in screen, screen
        threads = start_load(served.url, [PREFIX + "Top."], 16)
        screen = wait_screen(session, "running")
        for t in threads:
            t.join()
        assert "prefix hits" in screen and "K/V rows" in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


def wait_screen(session: str, text: str, timeout: float = 30) -> str:
    """The tmux pane's text once it shows `text`."""
    deadline = time.monotonic() + timeout
    while True:
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                text=True).stdout
        if text in screen or time.monotonic() > deadline:
            assert text in screen, screen
            return screen
        time.sleep(0.2)
