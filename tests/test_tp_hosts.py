"""Tensor parallel over two network hosts (kvserve/distributed/launch.py): node 0's engine in one network
namespace, `kvserve tp-node` in another (kvserve/distributed/netns.py), gloo over TCP between their
addresses, against one process on the same tiny random checkpoint; a lost host, a lost leader and a
follower that never comes fail loudly and in bounded time."""

import argparse
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from family_checkpoints import make_tiny_checkpoint
from helpers import TOL, free_port
from test_tensor_parallel import OPTIONS, _prompts

from kvserve import LLM, SamplingParams
from kvserve.distributed.netns import NetnsCluster, netns_available

REASON = netns_available()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PORT = 29517          # rank 0's store, on host 0's address (each cluster's hosts are fresh: the port is free)
PARAMS = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
KVSERVE = Path(sys.executable).parent / "kvserve"

# Runs in host 0: node 0's engine. With "pause": N it stops before its N-th step message, says so and
# waits for a line on stdin (the test kills a host meanwhile), then goes on.
DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from kvserve import LLM, SamplingParams

    spec = json.loads(sys.argv[1])
    def report(**kw):
        print("RESULT " + json.dumps(kw), flush=True)

    llm = LLM(spec["model"], **spec["options"])
    if spec.get("pause"):
        group, calls = llm.engine.tp.group, []
        send = group.broadcast_object
        def paused(obj=None):
            calls.append(obj)
            if len(calls) == spec["pause"]:
                report(paused=len(calls))
                sys.stdin.readline()
            return send(obj)
        group.broadcast_object = paused
    t0 = time.monotonic()
    try:
        outs = llm.generate(spec["prompts"], SamplingParams(**spec["params"]), use_tqdm=False)
        report(outputs=[[c.token_ids, [{str(t): p.logprob for t, p in s.items()} for s in c.logprobs]]
                        for o in outs for c in o.outputs])
    except RuntimeError as exc:
        report(error=str(exc), seconds=time.monotonic() - t0)
    llm.close()
    sys.stdout.flush()
    os._exit(0)   # gloo's threads can abort an interpreter teardown (see kvserve/distributed/worker.py)
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tp_hosts"))


@pytest.fixture
def cluster():
    """Two hosts."""
    with NetnsCluster(hosts=2) as c:
        yield c


def _leader(cluster, checkpoint, tmp_path, pause=None):
    h0 = cluster.hosts[0]
    spec = dict(model=checkpoint, prompts=_prompts(), params=PARAMS, pause=pause,
                options=dict(OPTIONS, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr=h0.ip,
                             master_port=PORT))
    return cluster.popen(h0, [sys.executable, "-c", DRIVER, json.dumps(spec)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=open(tmp_path / "leader.err", "w"), text=True)


def _follower(cluster, tmp_path):
    """`kvserve tp-node` in host 1: no model flags, the engine's config comes from node 0."""
    argv = [KVSERVE, "tp-node", "--nnodes", 2, "--node-rank", 1, "--master-addr", cluster.hosts[0].ip,
            "--master-port", PORT, "--tensor-parallel-size", 2, "--connect-timeout", 60]
    return cluster.popen(cluster.hosts[1], argv, stdout=subprocess.DEVNULL,
                         stderr=open(tmp_path / "follower.err", "w"))


def _result(driver, tmp_path) -> dict:
    for line in driver.stdout:
        if line.startswith("RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"the leader ended without a result:\n{_tail(tmp_path / 'leader.err')}\n"
                         f"follower:\n{_tail(tmp_path / 'follower.err')}")


def _tail(path, lines=30) -> str:
    text = [ln for ln in Path(path).read_text(errors="replace").splitlines() if not ln.startswith("frame #")]
    return "\n".join(text[-lines:])


def _completions(outs) -> list:
    """Token ids and top log-probs per completion, as the driver reports them (JSON: string keys)."""
    return [[c.token_ids, [{str(t): p.logprob for t, p in s.items()} for s in c.logprobs]]
            for o in outs for c in o.outputs]


@needs_netns
def test_two_hosts_equal_one_process(cluster, checkpoint, tmp_path):
    follower = _follower(cluster, tmp_path)      # before the leader: it waits for node 0's store
    driver = _leader(cluster, checkpoint, tmp_path)
    with LLM(checkpoint, **OPTIONS) as one:      # the oracle, while the two hosts load
        expected = _completions(one.generate(_prompts(), SamplingParams(**PARAMS), use_tqdm=False))
    got = _result(driver, tmp_path)
    assert "outputs" in got, got
    assert [tokens for tokens, _ in got["outputs"]] == [tokens for tokens, _ in expected]
    for (_, steps), (_, want) in zip(got["outputs"], expected):
        for step, ref in zip(steps, want, strict=True):
            assert step.keys() == ref.keys()
            assert all(abs(step[t] - ref[t]) < TOL for t in step), (step, ref)
    assert driver.wait(timeout=30) == 0
    assert follower.wait(timeout=30) == 0, _tail(tmp_path / "follower.err")
    assert "exited cleanly: rank 0 closed the engine" in _tail(tmp_path / "follower.err")


@needs_netns
def test_lost_host_fails_the_leader_naming_the_rank(cluster, checkpoint, tmp_path):
    follower = _follower(cluster, tmp_path)
    driver = _leader(cluster, checkpoint, tmp_path, pause=4)
    assert _result(driver, tmp_path) == {"paused": 4}   # mid-generation: three steps ran on both hosts
    cluster.kill_host(cluster.hosts[1])
    assert follower.poll() is not None and cluster.pids(cluster.hosts[1]) == []
    driver.stdin.write("go\n")
    driver.stdin.flush()
    got = _result(driver, tmp_path)
    assert "error" in got, got
    assert got["seconds"] < 15
    assert "tensor parallel engine failed: a collective failed" in got["error"]
    assert f"rank 1 on node 1 ({cluster.hosts[1].ip}) lost: its `kvserve tp-node` sent no heartbeat" \
        in got["error"]
    assert driver.wait(timeout=30) == 0


@needs_netns
def test_lost_leader_stops_the_follower(cluster, checkpoint, tmp_path):
    follower = _follower(cluster, tmp_path)
    driver = _leader(cluster, checkpoint, tmp_path, pause=2)
    assert _result(driver, tmp_path) == {"paused": 2}
    t0 = time.monotonic()
    cluster.kill_host(cluster.hosts[0])
    assert follower.wait(timeout=OPTIONS["tensor_parallel_timeout"]) == 1
    assert time.monotonic() - t0 < 10
    err = _tail(tmp_path / "follower.err")
    assert f"lost rank 0: its store at {cluster.hosts[0].ip}:{PORT} stopped answering" in err, err
    assert cluster.pids(cluster.hosts[1]) == []          # its rank was stopped too


def test_leader_without_its_follower_names_who_never_joined(checkpoint):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"start-up failed \(rank 1 never joined within 3 s: start `kvserve "
                       rf"tp-node --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {port}` on node 1"):
        LLM(checkpoint, **{**OPTIONS, "tensor_parallel_timeout": 3}, tensor_parallel_size=2, nnodes=2,
            master_port=port)
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=2, nnodes=2), "nnodes=2 needs master_port"),
    (dict(tensor_parallel_size=2, nnodes=3, master_port=29500), "tensor_parallel_size=2 does not split over nnodes=3"),
    (dict(tensor_parallel_size=1, nnodes=2, master_port=29500), "tensor_parallel_size=1 does not split over nnodes=2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500), "give 0..1, got 2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29500),
     "the engine runs on node 0 .*run `kvserve tp-node --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 "
     "--master-port 29500`"),
])
def test_launches_that_cannot_run_are_refused(checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint, **{**OPTIONS, **options})


def test_flags(capsys):
    from kvserve.cli import build_parser, main
    from kvserve.engine_args import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29500"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (2, 0, "10.0.0.1", 29500)
    assert build_parser().parse_args(["tp-node", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                                      "--master-port", "1"]).tensor_parallel_size is None
    assert main(["tp-node", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--master-port", "1"]) == 2
    assert "node 0 runs the engine itself" in capsys.readouterr().err
