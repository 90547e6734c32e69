"""Replicas on Ray Serve: two engines behind the KV-event-fed router, on a real local Ray.

One Ray session for the module: app "kvserve" (two replicas of the bundled model, prefix routing)
at /, and app "rr" at /rr, a second entry to the same replicas with round-robin routing; served
on loopback.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve

from kvserve.server.replicas import (
    ENGINE_DEPLOYMENT,
    REPLICA_HEADER,
    build_application,
    build_ingress,
    merge_metrics,
)

ENGINE = {"kv_cache_memory": "64MiB", "max_model_len": 512, "enforce_eager": True}
PREFIX = " ".join(f"Rule {i}: every answer names the colour of the sky over city number {i}." for i in range(12))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    """A local Ray with both apps deployed; the HTTP address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_application(ENGINE, {}, replicas=2, routing="prefix", events_host="127.0.0.1")
    serve.run_many([serve.RunTarget(app, name="kvserve", route_prefix="/")], wait_for_applications_running=False)
    round_robin = build_ingress(serve.get_deployment_handle(ENGINE_DEPLOYMENT, "kvserve"), routing="round-robin")
    serve.run(round_robin, name="rr", route_prefix="/rr")   # starts while the engines load
    _wait(lambda: serve.status().applications["kvserve"].status == "RUNNING", timeout=120,
          what="the replicas to start")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _complete(client: OpenAI, prompt: str, **kw):
    raw = client.completions.with_raw_response.create(model=None, prompt=prompt, max_tokens=2,
                                                      temperature=0, **kw)
    return raw.headers[REPLICA_HEADER], raw.parse()


def _replicas(base_url: str, hashes: bool = False) -> dict:
    r = httpx.get(f"{base_url}/v1/replicas", params={"hashes": "true"} if hashes else None, timeout=10)
    return r.json()["replicas"]


def _wait(cond, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_merge_metrics_labels_every_sample_and_keeps_one_header():
    one = ('# HELP x_total X.\n# TYPE x_total counter\nx_total{model_name="m"} 1.0\n'
           '# HELP y Y.\n# TYPE y gauge\ny 2.0\n')
    text = merge_metrics({"a": one, "b": one.replace("1.0", "3.0")})
    assert text.count("# TYPE x_total counter") == 1
    assert 'x_total{replica="a",model_name="m"} 1.0' in text and 'x_total{replica="b",model_name="m"} 3.0' in text
    lines = text.splitlines()
    assert lines.index('x_total{replica="b",model_name="m"} 3.0') < lines.index('y{replica="a"} 2.0')


def test_shared_prefix_lands_on_the_replica_holding_it(base_url):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    first, out = _complete(client, PREFIX + " Question: city 0?")
    assert out.usage.prompt_tokens > 200
    _wait(lambda: sum(_replicas(base_url)[first]["blocks"].values()) >= out.usage.prompt_tokens // 16,
          what="the first prompt's blocks in the index")
    for i in range(1, 4):
        served, out = _complete(client, PREFIX + f" Question: city {i}?")
        assert served == first
        assert out.usage.prompt_tokens_details.cached_tokens >= 192
    # a stream with the same prefix goes there too
    body = {"prompt": PREFIX + " Question: city 7?", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == first
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192


def test_round_robin_alternates(base_url):
    client = OpenAI(base_url=f"{base_url}/rr/v1", api_key="none", max_retries=0, timeout=60)
    served = [_complete(client, PREFIX + " Question: any city?")[0] for _ in range(4)]
    assert served[0] != served[1] and served[0::2] == [served[0]] * 2 and served[1::2] == [served[1]] * 2


def test_chat_routes_and_models_health_metrics(base_url):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content
    assert [m.id for m in client.models.list().data]
    assert httpx.get(f"{base_url}/health", timeout=10).json() == {"status": "ok"}
    metrics = httpx.get(f"{base_url}/metrics", timeout=20).text
    names = set(_replicas(base_url))
    for name in names:
        assert f'kvserve:prompt_tokens_total{{replica="{name}"' in metrics
    assert metrics.count("# TYPE kvserve:prompt_tokens_total ") == 1
    bad = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_index_matches_each_engines_cached_blocks(base_url):
    def matches():
        index = _replicas(base_url, hashes=True)
        for name, entry in index.items():
            engine = httpx.get(f"{base_url}/v1/kv/cached", headers={REPLICA_HEADER: name}, timeout=10)
            assert engine.headers[REPLICA_HEADER] == name
            if set(entry["hashes"].get("0", [])) != set(engine.json()["hashes"]):
                return False
        return True
    _wait(matches, what="the index to equal the engines' cached blocks")


def test_killed_replica_ends_its_stream_and_the_other_serves(base_url):
    index = _replicas(base_url)
    victim, survivor = sorted(index)
    body = {"prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers={REPLICA_HEADER: victim},
                      timeout=30) as r:
        assert r.headers[REPLICA_HEADER] == victim
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        ray.kill(ray.get_actor(index[victim]["actor_name"], namespace="serve"), no_restart=True)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and "error" in json.loads(rest[-2])
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(3):
        served, out = _complete(client, f"After the fault, request {i}:")
        assert served != victim and out.choices[0].text is not None
    _wait(lambda: victim not in _replicas(base_url), what="the index to drop the dead replica")
