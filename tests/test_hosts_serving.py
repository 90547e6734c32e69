"""`kvserve serve --replicas` and `--disaggregate` across separate network hosts.

Three network namespaces (kvserve/distributed/netns.py): a Ray head with no CPUs to give in host 0,
where `kvserve serve` runs as a user runs it, and a 1-CPU Ray worker node in each of hosts 1 and 2,
so each engine replica (`--replica-num-cpus 1`) lands on a host of its own. The replicas share a
Redis tier served from the root namespace's bridge address; the router in host 0 follows their KV
events over the hosts' network. Then host 2 dies mid-stream and comes back; then the same cluster
serves one prefill and one decode replica, the KV moving between hosts through the TCP connector.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import RedisServer
from openai import OpenAI
from replica_helpers import metrics, pinned, stream_killed_midway, wait

from kvserve.distributed.netns import QUICK_FAILURE_DETECTION, NetnsCluster, netns_available
from kvserve.server.replicas import PREFILL_HEADER, REPLICA_HEADER

REASON = netns_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PORT = 8000
ENGINE_FLAGS = ["--enforce-eager", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--uvicorn-log-level",
                "warning"]
DOC = " ".join(f"Entry {i}: ferry number {i} leaves the harbour at {i} o'clock with {3 * i} bicycles."
               for i in range(12))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray")
    cluster = NetnsCluster(hosts=3)
    redis = None
    try:
        redis = RedisServer(tmp_path_factory.mktemp("redis"), host=cluster.bridge_ip)
        cluster.redis_url = redis.url
        cluster.start_ray(head_num_cpus=0, num_cpus=1, env=QUICK_FAILURE_DETECTION)
        yield cluster
    finally:
        cluster.close()
        if redis is not None:
            redis.stop()


class Served:
    """`kvserve serve ...` in host 0 of `cluster`, on PORT."""

    def __init__(self, cluster, *flags: str, log_path):
        self.cluster, self.log_path = cluster, log_path
        self.url = f"http://{cluster.hosts[0].ip}:{PORT}"
        argv = [str(Path(sys.executable).parent / "kvserve"), "serve", "--ray-address", cluster.ray_address,
                "--host", "0.0.0.0", "--port", str(PORT), "--replica-num-cpus", "1", *ENGINE_FLAGS, *flags]
        with open(log_path, "wb") as log:
            self.proc = cluster.popen(cluster.hosts[0], argv, stdout=log, stderr=subprocess.STDOUT)
        wait(self.ready, timeout=240, what=f"kvserve serve {' '.join(flags)} (log: {log_path})")

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            return httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200 and len(self.nodes()) >= 1
        except httpx.HTTPError:
            return False

    def replicas(self) -> dict:
        return httpx.get(f"{self.url}/v1/replicas", timeout=20).json()

    def nodes(self, deployment: str | None = None) -> dict[str, str]:
        """replica -> the host address it runs on."""
        view = self.replicas()
        view = view[deployment] if deployment else view
        return {name: r["node"] for name, r in view["replicas"].items() if r["node"]}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)   # the application is deleted; the cluster goes on
        try:
            assert self.proc.wait(timeout=60) == 0, self.log_path.read_text()[-3000:]
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def colocated(cluster, tmp_path_factory):
    served = Served(cluster, "--replicas", "2", "--kv-tier", cluster.redis_url,
                    log_path=tmp_path_factory.mktemp("serve") / "colocated.log")
    wait(lambda: len(served.nodes()) == 2, timeout=120, what="both replicas to report their hosts")
    yield served
    served.stop()


def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_replicas_run_on_their_own_hosts_behind_one_router(colocated, cluster):
    nodes = colocated.nodes()
    assert sorted(nodes.values()) == sorted(h.ip for h in cluster.hosts[1:])
    view = colocated.replicas()["replicas"]
    wait(lambda: all(r["following_events"] for r in colocated.replicas()["replicas"].values()),
         what="the router to follow both replicas' KV events")
    # a shared prefix lands on the replica whose blocks the router learnt of from the other host's events
    first = client(colocated).completions.with_raw_response.create(model=None, prompt=DOC + " Question one?",
                                                                   max_tokens=2, temperature=0)
    holder = first.headers[REPLICA_HEADER]
    wait(lambda: colocated.replicas()["replicas"][holder]["blocks"].get("0", 0) >= 6,
         what="the holder's blocks in the router's index")
    for q in ("two", "three"):
        again = client(colocated).completions.with_raw_response.create(model=None, prompt=f"{DOC} Question {q}?",
                                                                       max_tokens=2, temperature=0)
        assert again.headers[REPLICA_HEADER] == holder
    assert set(view) == set(nodes)


def test_the_redis_tier_carries_a_prompt_between_hosts(colocated):
    a, b = sorted(colocated.nodes())
    prompt = "Across hosts. " + DOC
    out_a = pinned(client(colocated), a, prompt)
    full_blocks = (out_a.usage.prompt_tokens - 1) // 16

    def written():
        m = metrics(colocated.url, a)
        return (m["kvserve:kv_tier_pending_writes[tier=redis]"] == 0
                and m["kvserve:kv_tier_written_entries_total[tier=redis]"] >= full_blocks)
    wait(written, what="replica A's blocks in Redis")
    out_b = pinned(client(colocated), b, prompt)
    assert out_b.usage.prompt_tokens_details.cached_tokens == 16 * full_blocks
    assert out_b.choices[0].text == out_a.choices[0].text


def test_a_dead_host_ends_its_streams_the_other_serves_and_it_rejoins(colocated, cluster):
    nodes = colocated.nodes()
    victim = next(name for name, ip in nodes.items() if ip == cluster.hosts[2].ip)
    stream_killed_midway(colocated.url, victim, lambda: cluster.kill_host(cluster.hosts[2]))
    for i in range(3):
        raw = client(colocated).completions.with_raw_response.create(model=None, prompt=f"After the fault {i}:",
                                                                     max_tokens=4, temperature=0)
        assert raw.status_code == 200 and raw.headers[REPLICA_HEADER] != victim
    wait(lambda: victim not in colocated.replicas()["replicas"], timeout=60, what="the router to drop the dead replica")
    # the host comes back: Ray counts it again and Serve places the missing replica there
    cluster.rejoin(cluster.hosts[2], alive=3)
    wait(lambda: cluster.hosts[2].ip in colocated.nodes().values() and len(colocated.nodes()) == 2,
         timeout=240, what="a replica on the rejoined host")
    back = next(name for name, ip in colocated.nodes().items() if ip == cluster.hosts[2].ip)
    assert back != victim and pinned(client(colocated), back, "Back again:").choices[0].text is not None


def test_disaggregated_prefill_and_decode_on_two_hosts_equal_colocated(colocated, cluster, tmp_path):
    prompt = "Disaggregated. " + DOC
    args = dict(model=None, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    want = client(colocated).completions.create(**args).choices[0].text
    colocated.stop()
    served = Served(cluster, "--disaggregate", "1:1", log_path=tmp_path / "disaggregated.log")
    try:
        wait(lambda: len(served.nodes()) == 1 and len(served.nodes("prefill")) == 1, timeout=120,
             what="the prefill and the decode replica")
        prefill_ip, decode_ip = next(iter(served.nodes("prefill").values())), next(iter(served.nodes().values()))
        assert {prefill_ip, decode_ip} == {h.ip for h in cluster.hosts[1:]}
        raw = client(served).completions.with_raw_response.create(**args)
        out = raw.parse()
        assert raw.headers[PREFILL_HEADER] in served.nodes("prefill")
        assert raw.headers[REPLICA_HEADER] in served.nodes()
        assert out.choices[0].text == want
        assert out.usage.prompt_tokens_details.cached_tokens == (out.usage.prompt_tokens - 1) // 16 * 16
        streamed = client(served).completions.create(**args, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        decode = metrics(served.url, raw.headers[REPLICA_HEADER])
        assert decode["kvserve:kv_transfer_received_blocks_total"] >= (out.usage.prompt_tokens - 1) // 16
        bad = httpx.post(f"{served.url}/v1/completions", json={"prompt": prompt, "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400   # the prefill replica's own answer, and both keep serving
        assert client(served).completions.create(**args).choices[0].text == want
    finally:
        served.stop()
