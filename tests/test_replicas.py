"""Replicas on Ray Serve: two engines behind the KV-event-fed router, on a real local Ray.

One Ray session for the module: app "kvserve" (two replicas of the bundled model, prefix routing)
at /, and app "rr" at /rr, a second entry to the same replicas with round-robin routing; served
on loopback. Both replicas share one Redis KV tier (a private redis-server, write-through), so a
prompt one replica computed is loaded from Redis by the other; a later test kills that Redis
(and starts it again on the same port when done).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import ray
from conftest import RedisServer
from openai import OpenAI
from ray import serve
from replica_helpers import metrics as _metrics
from replica_helpers import pinned as _pinned
from replica_helpers import stream_killed_midway
from replica_helpers import wait as _wait

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
def redis_tier(tmp_path_factory):
    """The replicas' shared Redis tier: a private redis-server for the module."""
    server = RedisServer(workdir := tmp_path_factory.mktemp("redis"))
    server.workdir = workdir
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base_url(redis_tier):
    """A local Ray with both apps deployed; the HTTP address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = {**ENGINE, "kv_tiers": [redis_tier.url]}
    app = build_application(engine, {"metrics_names": "vllm"}, replicas=2, routing="prefix", events_host="127.0.0.1")
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
    for name in names:                                        # --metrics-names vllm reaches the replicas
        assert f'vllm:prompt_tokens_total{{replica="{name}"' in metrics
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


REDIS_DOC = " ".join(f"Entry {i}: ferry number {i} leaves the harbour at {i} o'clock with {3 * i} bicycles."
                     for i in range(14))


def test_redis_tier_carries_a_prompt_from_one_replica_to_the_other(base_url):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    a, b = sorted(_replicas(base_url))
    before_b = _metrics(base_url, b)
    out_a = _pinned(client, a, REDIS_DOC)
    full_blocks = (out_a.usage.prompt_tokens - 1) // 16         # the blocks a prefix lookup can hit
    assert out_a.usage.prompt_tokens > 300 and out_a.usage.prompt_tokens_details.cached_tokens == 0

    def written():  # write-through: every full block of the prompt in Redis, nothing pending
        m = _metrics(base_url, a)
        return (m["kvserve:kv_tier_pending_writes[tier=redis]"] == 0
                and m["kvserve:kv_tier_written_entries_total[tier=redis]"] >= full_blocks)
    _wait(written, what="replica A's blocks written to Redis")
    out_b = _pinned(client, b, REDIS_DOC)                       # B never saw it: its blocks come from Redis
    after_b = _metrics(base_url, b)
    assert out_b.usage.prompt_tokens_details.cached_tokens == 16 * full_blocks
    hits = after_b["kvserve:kv_tier_hits_total[tier=redis]"] - before_b["kvserve:kv_tier_hits_total[tier=redis]"]
    by_source = "kvserve:prefix_cache_hits_by_source_total[source=redis]"
    assert hits == full_blocks and after_b[by_source] - before_b.get(by_source, 0) == 16 * full_blocks
    assert after_b["kvserve:kv_tier_errors_total[tier=redis]"] == 0
    assert out_b.choices[0].text == out_a.choices[0].text


def test_redis_down_both_replicas_keep_serving(base_url, redis_tier):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=30)
    names = sorted(_replicas(base_url))
    fresh = REDIS_DOC.replace("ferry", "train")                 # never seen: no block of it cached anywhere
    short = "The harbour master counts the bicycles:"
    expected = {name: _pinned(client, name, short).choices[0].text for name in names}
    redis_tier.stop()                                           # Redis dies (SIGKILL)
    try:
        texts = {}
        for name in names:                                      # a new prompt: lookups and writes fail
            t0 = time.monotonic()
            out = _pinned(client, name, fresh)
            texts[name] = out.choices[0].text
            assert out.usage.prompt_tokens_details.cached_tokens == 0 and time.monotonic() - t0 < 20
        assert texts[names[0]] == texts[names[1]]
        for name in names:                                      # later requests neither hang nor fail
            t0 = time.monotonic()
            assert _pinned(client, name, short).choices[0].text == expected[name]
            assert time.monotonic() - t0 < 20
        body = {"prompt": fresh + " Once more:", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
        errors = [_metrics(base_url, name)["kvserve:kv_tier_errors_total[tier=redis]"] for name in names]
        assert all(e >= 1 for e in errors)                       # counted, not raised
    finally:
        redis_tier.proc = RedisServer(redis_tier.workdir, port=redis_tier.port).proc   # back, empty


def test_killed_replica_ends_its_stream_and_the_other_serves(base_url):
    index = _replicas(base_url)
    victim, survivor = sorted(index)
    actor = index[victim]["actor_name"]
    stream_killed_midway(base_url, victim, lambda: ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True))
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(3):
        served, out = _complete(client, f"After the fault, request {i}:")
        assert served != victim and out.choices[0].text is not None
    _wait(lambda: victim not in _replicas(base_url), what="the index to drop the dead replica")
