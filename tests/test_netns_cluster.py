"""NetnsCluster (kvserve/distributed/netns.py): separate network hosts on one machine, and Ray on them."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from kvserve.distributed.netns import (
    ETC_NETNS,
    QUICK_FAILURE_DETECTION,
    NetnsCluster,
    links,
    namespaces,
    netns_available,
    pid_alive,
)

REASON = netns_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PY = sys.executable

ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen()
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        with c:
            c.sendall(c.recv(1024))
""")

ECHO_CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
        c.sendall(b"hello")
        print(c.recv(1024).decode())
""")

# Runs in the head's namespace: one task per node, then (after the test kills host 2) waits for the
# head to see that node dead and runs one more task on host 1.
DRIVER = textwrap.dedent("""
    import json, sys, time
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    address, ips = sys.argv[1], json.loads(sys.argv[2])
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    node_ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}

    @ray.remote(num_cpus=1)
    def where():
        return ray.util.get_node_ip_address()

    def on(ip):
        strategy = NodeAffinitySchedulingStrategy(node_ids[ip], soft=False)
        return where.options(scheduling_strategy=strategy).remote()

    print("RESULT", json.dumps({"ips": ray.get([on(ip) for ip in ips], timeout=60)}), flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 45
    while any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == ips[2]):
        if time.monotonic() > deadline:
            print("RESULT", json.dumps({"error": "the killed node is still alive"}), flush=True)
            sys.exit(1)
        time.sleep(0.2)
    print("RESULT", json.dumps({"dead": ips[2], "survivor": ray.get(on(ips[1]), timeout=60)}), flush=True)
""")

def result(driver, cluster) -> dict:
    """The driver's next RESULT line (Ray prints its own messages to the driver's stdout too)."""
    for line in driver.stdout:
        if line.startswith("RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"driver failed: {driver.stderr.read()[-3000:]}\n{cluster.ray_logs()}")


def addresses(cluster, host) -> list[str]:
    out = cluster.run(host, ["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True)
    return [line.split()[3].split("/")[0] for line in out.stdout.splitlines()]


def test_hosts_are_separate_and_reachable():
    cluster = NetnsCluster(hosts=2)
    h0, h1 = cluster.hosts
    names = [h0.name, h1.name, cluster.bridge]
    try:
        assert h0.ip != h1.ip and len(cluster.bridge_ip.split(".")) == 4
        assert addresses(cluster, h0) == ["127.0.0.1", h0.ip]
        assert addresses(cluster, h1) == ["127.0.0.1", h1.ip]

        server = cluster.popen(h1, [PY, "-c", ECHO_SERVER, h1.ip, "7000"], stdout=subprocess.PIPE,
                               text=True)
        assert server.stdout.readline().strip() == "ready"
        done = cluster.run(h0, [PY, "-c", ECHO_CLIENT, h1.ip, "7000"], capture_output=True,
                           text=True, timeout=30)
        assert done.stdout.strip() == "hello", done.stderr
        with socket.create_connection((h1.ip, 7000), timeout=5) as c:   # from the root namespace
            c.sendall(b"root")
            assert c.recv(1024) == b"root"
        # host 0 has no listener of its own at 7000: the port is host 1's alone
        refused = cluster.run(h0, [PY, "-c", ECHO_CLIENT, h0.ip, "7000"], capture_output=True,
                              text=True, timeout=30)
        assert refused.returncode != 0 and "ConnectionRefused" in refused.stderr
    finally:
        cluster.close()
    cluster.close()   # idempotent
    assert server.poll() is not None
    assert not set(names[:2]) & set(namespaces())
    assert not {n for n in links() if n.startswith(cluster.tag)}
    assert not [d for d in names[:2] if (ETC_NETNS / d).exists()]   # their resolv.conf folders too


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    cluster = NetnsCluster(hosts=3)
    try:
        cluster.start_ray(env=QUICK_FAILURE_DETECTION)
        yield cluster
    finally:
        cluster.close()


def test_ray_nodes_are_hosts_and_survive_a_host_failure(ray_cluster):
    cluster = ray_cluster
    ips = [h.ip for h in cluster.hosts]
    driver = cluster.popen(cluster.hosts[0], [PY, "-c", DRIVER, cluster.ray_address, json.dumps(ips)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        placed = result(driver, cluster)["ips"]
        assert placed == ips and len(set(placed)) == 3

        cluster.kill_host(cluster.hosts[2])
        assert cluster.pids(cluster.hosts[2]) == []
        driver.stdin.write("go\n")
        driver.stdin.flush()
        assert result(driver, cluster) == {"dead": ips[2], "survivor": ips[1]}
        assert driver.wait(timeout=30) == 0
    finally:
        if driver.poll() is None:
            driver.kill()


def test_close_leaves_no_process(ray_cluster):
    cluster = ray_cluster
    # one that leaves the cluster's process group: close() finds it by its namespace
    escaped = cluster.run(cluster.hosts[1], [PY, "-c", "import subprocess; print(subprocess.Popen("
                          "['sleep', '600'], start_new_session=True, stdout=subprocess.DEVNULL, "
                          "stderr=subprocess.DEVNULL).pid)"], capture_output=True,
                          text=True, check=True)
    pids = set(cluster.pids()) | {p.pid for _, p in cluster.state.procs} | {int(escaped.stdout)}
    assert len(pids) > 10                     # Ray's processes on the two live hosts
    cluster.close()
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert not {h.name for h in cluster.hosts} & set(namespaces())
    assert not {n for n in links() if n.startswith(cluster.tag)}
