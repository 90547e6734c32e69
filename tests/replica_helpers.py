"""Helpers for the tests of replicas behind the Ray Serve ingress (one host or several)."""

import json
import time

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.replicas import REPLICA_HEADER


def metrics(base_url: str, replica: str) -> dict:
    """One replica's kvserve:* samples, keyed by name and labels other than model_name."""
    r = httpx.get(f"{base_url}/metrics", headers={REPLICA_HEADER: replica}, timeout=20)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == replica
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + labels] = s.value
    return out


def pinned(client: OpenAI, replica: str, prompt: str, max_tokens: int = 6):
    """A greedy completion on `replica` only; asserts that it served it."""
    raw = client.completions.with_raw_response.create(model=None, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, extra_headers={REPLICA_HEADER: replica})
    assert raw.status_code == 200 and raw.headers[REPLICA_HEADER] == replica
    return raw.parse()


def wait(cond, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def stream_killed_midway(base_url: str, replica: str, kill) -> None:
    """Stream a long completion from `replica`, call `kill()` after its first event, and check the
    stream ends with an error event and [DONE]."""
    body = {"prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers={REPLICA_HEADER: replica},
                      timeout=60) as r:
        assert r.headers[REPLICA_HEADER] == replica
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        kill()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and "error" in json.loads(rest[-2])
