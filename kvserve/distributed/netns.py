"""Separate network hosts on one Linux machine, for tests and benchmarks.

A `NetnsCluster` makes one network namespace per host, each joined by a veth pair to a bridge in
the root namespace. Every host sees only its own address on `eth0` (plus `lo`) and reaches the
others, and the root namespace (at `bridge_ip`), over the bridge. Needs root and `ip` (iproute2).

    with NetnsCluster(hosts=3) as cluster:
        address = cluster.start_ray()                  # head on hosts[0], workers on 1 and 2
        driver = cluster.popen(cluster.hosts[0], [sys.executable, "driver.py", address])
        driver.wait()
        cluster.kill_host(cluster.hosts[2])            # a node failure

A Ray driver needs a raylet on its own host, so it runs inside a namespace, as above; the test
process (in the root namespace) reaches the hosts' ports at their addresses, Ray's included.
`popen` and `run` give every process `cluster.env` (Ray's auth mode among them: the nodes and
their drivers must agree on it), under the caller's environment. Stop a Ray node with
`kill_host`, never `ray stop` (that kills every Ray process on the machine).
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

IFNAME_MAX = 15
DEFAULT_PREFIX = "kvs"
SUBNET_BASE = "10.213"
LOCK_PATH = os.path.join(tempfile.gettempdir(), "kvserve-netns.lock")
RAY_PORT = 6379
ETC_NETNS = Path("/etc/netns")
RAY_LOG_FILES = ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err")
# Ray settings for a quick verdict on a killed node (dead after ~3 missed 500 ms health checks)
QUICK_FAILURE_DETECTION = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                           "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "500"}

_counter = itertools.count()


@dataclass(frozen=True)
class Host:
    """One host: its namespace's name, its address and its place in the cluster."""

    name: str
    ip: str
    index: int


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS`; raise with its stderr when `check` and it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def pid_alive(pid: int) -> bool:
    """Whether `pid` names a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def make_tag(prefix: str, pid: int, number: int) -> str:
    """A name stem unique to one cluster: the prefix, the owner's pid and a counter (in hex)."""
    return f"{prefix}{pid:x}x{number:x}"


def tag_pid(name: str, prefix: str) -> int | None:
    """The owner's pid in a name made by `make_tag`, or None if it is not one of ours."""
    m = re.match(rf"{re.escape(prefix)}([0-9a-f]+)x[0-9a-f]+", name)
    return int(m.group(1), 16) if m else None


def namespaces() -> list[str]:
    """The named network namespaces."""
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def links() -> list[str]:
    """The interfaces of the root namespace."""
    out = ip("-o", "link", "show").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def netns_pids(ns: str) -> list[int]:
    """The processes living in namespace `ns`."""
    done = ip("netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_pids(pids) -> None:
    """SIGKILL each of `pids`, ignoring those already gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that `proc` leads and reap `proc`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def clean_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove the namespaces and interfaces named with `prefix` whose owning process is gone."""
    removed = []
    for ns in namespaces():
        pid = tag_pid(ns, prefix)
        if pid is not None and not pid_alive(pid):
            kill_pids(netns_pids(ns))
            if ip("netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
    for link in links():
        pid = tag_pid(link, prefix)
        if pid is not None and not pid_alive(pid):
            if ip("link", "del", link, check=False).returncode == 0:
                removed.append(link)
    for d in ETC_NETNS.glob(f"{prefix}*"):
        pid = tag_pid(d.name, prefix)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
    for d in Path("/tmp").glob(f"ray-{prefix}*"):
        pid = tag_pid(d.name[len("ray-"):], prefix)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks routed on this machine (the default route aside)."""
    nets = []
    for line in ip("-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if not words:
            continue
        dest = words[1] if words[0] in ("local", "broadcast", "unicast", "blackhole") else words[0]
        if dest == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            pass
    return nets


def free_subnet(start: int = 0) -> str:
    """A /24 under 10.213.0.0/16 that overlaps no route on this machine."""
    used = used_networks()
    for i in range(256):
        net = ipaddress.ip_network(f"{SUBNET_BASE}.{(start + i) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise RuntimeError(f"no free /24 under {SUBNET_BASE}.0.0/16")


class _Lock:
    """An exclusive lock across processes, held while a cluster picks and claims its subnet."""

    def __enter__(self):
        self.f = open(LOCK_PATH, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


@dataclass
class _State:
    """What a cluster must undo: its processes, namespaces, interfaces and temp dirs."""

    bridge: str
    namespaces: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    def kill(self, ns: str) -> None:
        for owner, proc in self.procs:
            if owner == ns:
                kill_group(proc)
        for _ in range(3):                    # a process forked while we kill is caught next round
            pids = netns_pids(ns)
            if not pids:
                break
            kill_pids(pids)
            time.sleep(0.05)

    def close(self) -> None:
        for ns in self.namespaces:
            self.kill(ns)
        for ns in self.namespaces:
            ip("netns", "del", ns, check=False)
        existing = set(links())
        for link in [*self.veths, self.bridge]:
            if link in existing:
                ip("link", "del", link, check=False)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


class NetnsCluster:
    """`hosts` network namespaces on one bridge: separate network hosts on one machine.

    Host i has address .{i+1} of the subnet (a free /24 under 10.213.0.0/16 unless given) and the
    root namespace has `bridge_ip` (.254) on the bridge. Each host's default route points at the
    bridge, so code that finds its own address by routing outward finds the host's address
    (nothing here sets up forwarding or NAT: the hosts reach only each other and this machine).
    """

    def __init__(self, hosts: int = 3, subnet: str | None = None, prefix: str = DEFAULT_PREFIX):
        if not 1 <= hosts <= 253:
            raise ValueError(f"hosts must be in 1..253, not {hosts}")
        self.tag = make_tag(prefix, os.getpid(), next(_counter))
        if len(self.tag) + 2 + len(f"{hosts - 1:x}") > IFNAME_MAX:
            raise ValueError(f"prefix {prefix!r} is too long for {IFNAME_MAX}-character interface names")
        self.prefix = prefix
        self.state = _State(bridge=f"{self.tag}br")
        self._finalizer = weakref.finalize(self, self.state.close)
        self.hosts: list[Host] = []
        self.ray_address: str | None = None
        self._ray_node: dict = {}      # how start_ray started a worker node (rejoin starts it again)
        self.env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        clean_stale(prefix)
        try:
            with _Lock():
                self.subnet = subnet or free_subnet(os.getpid())
                net = ipaddress.ip_network(self.subnet)
                if net.prefixlen != 24:
                    raise ValueError(f"subnet must be a /24, not {self.subnet}")
                addresses = list(net.hosts())
                self.bridge_ip = str(addresses[-1])
                self._make_bridge()
            for i in range(hosts):
                self._add_host(i, str(addresses[i]))
        except BaseException:
            self.close()
            raise

    @property
    def bridge(self) -> str:
        return self.state.bridge

    def _make_bridge(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def _add_host(self, index: int, address: str) -> None:
        ns, veth = f"{self.tag}h{index:x}", f"{self.tag}v{index:x}"
        ip("netns", "add", ns)
        self.state.namespaces.append(ns)
        self._no_resolver(ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.state.veths.append(veth)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "route", "add", "default", "via", self.bridge_ip)
        self.hosts.append(Host(name=ns, ip=address, index=index))

    def _no_resolver(self, ns: str) -> None:
        """A resolv.conf naming no reachable server for `ns` (`ip netns exec` mounts /etc/netns/NS/
        over /etc/): a name lookup there (torch's store looks up its peers) fails at once instead of
        waiting out the resolver's timeout."""
        d = ETC_NETNS / ns
        d.mkdir(parents=True, exist_ok=True)
        self.state.dirs.append(str(d))
        (d / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def host(self, host: Host | int) -> Host:
        """`host` itself, or the host with that index."""
        return self.hosts[host] if isinstance(host, int) else host

    def command(self, host: Host | int, argv) -> list[str]:
        """`argv` prefixed to run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.host(host).name, *map(str, argv)]

    def environ(self, env: dict | None = None) -> dict:
        """`env` (os.environ by default) over the cluster's settings, `self.env`."""
        return {**self.env, **(os.environ if env is None else env)}

    def popen(self, host: Host | int, argv, **kw) -> subprocess.Popen:
        """Start `argv` in `host`, in its own process group; `close`/`kill_host` kill it.

        Keywords are `subprocess.Popen`'s; the environment gets `self.env` underneath.
        """
        if not self._finalizer.alive:
            raise RuntimeError("the cluster is closed")
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw["env"] = self.environ(kw.get("env"))
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **kw)
        self.state.procs.append((self.host(host).name, proc))
        return proc

    def run(self, host: Host | int, argv, **kw) -> subprocess.CompletedProcess:
        """Run `argv` in `host` to completion (keywords as `subprocess.run`, env as `popen`)."""
        kw["env"] = self.environ(kw.get("env"))
        return subprocess.run(self.command(host, argv), **kw)

    def pids(self, host: Host | int | None = None) -> list[int]:
        """The processes now living in `host` (every host when None)."""
        hosts = self.hosts if host is None else [self.host(host)]
        return [pid for h in hosts for pid in netns_pids(h.name)]

    def kill_host(self, host: Host | int) -> None:
        """SIGKILL every process started in `host`: a host failure (the network stays up)."""
        self.state.kill(self.host(host).name)

    def close(self) -> None:
        """Kill every process the cluster started and remove its namespaces and interfaces."""
        self._finalizer()

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- Ray ---------------------------------------------------------------------------

    def ray_dir(self, host: Host | int) -> str:
        """The Ray temp dir of `host`."""
        return f"/tmp/ray-{self.tag}-{self.host(host).index}"

    def start_ray(self, head: int = 0, workers=(1, 2), num_cpus: int = 1, port: int = RAY_PORT,
                  timeout: float = 120.0, env: dict | None = None,
                  object_store_memory: int = 100 * 2**20, head_num_cpus: int | None = None) -> str:
        """Start a Ray head in host `head` and a worker node in each of `workers`.

        Returns the GCS address "IP:PORT" once every node is alive. `env` adds to the nodes'
        environment (Ray's `RAY_...` settings, for instance). The head offers `head_num_cpus`
        CPUs (default `num_cpus`; 0 keeps CPU-asking actors off it), each worker `num_cpus`.
        """
        if self.ray_address:
            raise RuntimeError(f"Ray already runs on this cluster at {self.ray_address}")
        head_host = self.host(head)
        address = f"{head_host.ip}:{port}"
        self._ray_node = {"env": {**os.environ, **(env or {})}, "object_store_memory": object_store_memory,
                          "num_cpus": num_cpus, "head": head_host}
        deadline = time.monotonic() + timeout
        nodes = [head_host] + [self.host(w) for w in workers]
        head_cpus = num_cpus if head_num_cpus is None else head_num_cpus
        procs = [self._ray_start(head_host, ["--head", "--port", port, "--include-dashboard=false"], head_cpus)]
        self._wait_port(head_host.ip, port, deadline, procs, nodes)
        procs += [self._ray_start(h, ["--address", address], num_cpus) for h in nodes[1:]]
        self._wait_nodes(head_host, address, len(nodes), deadline, procs, nodes)
        self.ray_address = address
        return address

    def rejoin(self, host: Host | int, alive: int, timeout: float = 120.0) -> None:
        """Start `host`'s Ray worker node again (after `kill_host`), as start_ray did; return once
        the head counts `alive` live nodes."""
        if not self.ray_address:
            raise RuntimeError("start_ray first")
        host = self.host(host)
        proc = self._ray_start(host, ["--address", self.ray_address], self._ray_node["num_cpus"])
        self._wait_nodes(self._ray_node["head"], self.ray_address, alive, time.monotonic() + timeout, [proc], [host])

    def _ray_start(self, host: Host, argv: list, num_cpus: int) -> subprocess.Popen:
        """`ray start ARGV --block` in `host` (its log in the host's Ray temp dir)."""
        d = self.ray_dir(host)
        os.makedirs(d, exist_ok=True)
        if d not in self.state.dirs:
            self.state.dirs.append(d)
        node = self._ray_node
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--block", "--num-cpus", num_cpus, "--num-gpus", 0, "--disable-usage-stats",
                  "--object-store-memory", node["object_store_memory"], "--node-ip-address", host.ip,
                  "--temp-dir", d]
        with open(os.path.join(d, "ray-start.log"), "ab") as log:
            return self.popen(host, [ray, "start", *argv, *common], stdout=log, stderr=subprocess.STDOUT,
                              env=node["env"])

    def _ray_failure(self, message: str, nodes) -> RuntimeError:
        return RuntimeError(f"{message}\n{self.ray_logs(nodes)}")

    def ray_logs(self, hosts=None, lines: int = 20) -> str:
        """The last `lines` of each host's `ray start` output and Ray's GCS/raylet logs."""
        parts = []
        for host in map(self.host, self.hosts if hosts is None else hosts):
            d = Path(self.ray_dir(host))
            files = [d / "ray-start.log"] + [d / "session_latest" / "logs" / f for f in RAY_LOG_FILES]
            for f in files:
                try:
                    tail = f.read_text(errors="replace").splitlines()[-lines:]
                except OSError:
                    continue
                if tail:
                    parts.append(f"--- {host.name} {f.name}\n" + "\n".join(tail))
        return "\n".join(parts) or "(no Ray logs)"

    def _check_running(self, procs, nodes) -> None:
        for proc in procs:
            if proc.poll() is not None:
                raise self._ray_failure(f"`ray start` exited with {proc.returncode}", nodes)

    def _wait_port(self, host_ip: str, port: int, deadline: float, procs, nodes) -> None:
        while True:
            self._check_running(procs, nodes)
            try:
                socket.create_connection((host_ip, port), timeout=1).close()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise self._ray_failure(f"Ray's GCS did not listen on {host_ip}:{port} in time", nodes)
            time.sleep(0.2)

    def _wait_nodes(self, head: Host, address: str, count: int, deadline: float, procs, nodes):
        script = textwrap.dedent(f"""
            import time, ray
            ray.init(address={address!r}, log_to_driver=False, logging_level="ERROR")
            while True:
                alive = sum(n["Alive"] for n in ray.nodes())
                if alive >= {count}:
                    break
                time.sleep(0.2)
            print(alive)
        """)
        driver = self.popen(head, [sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
        while driver.poll() is None:
            self._check_running(procs, nodes)
            if time.monotonic() > deadline:
                kill_group(driver)
                raise self._ray_failure(f"Ray did not show {count} nodes alive in time", nodes)
            time.sleep(0.2)
        out = driver.stdout.read().decode(errors="replace")
        driver.stdout.close()
        if driver.returncode:
            raise self._ray_failure(f"the Ray driver checking the nodes failed:\n{out[-2000:]}", nodes)


def netns_available() -> str | None:
    """None when network namespaces, veths and bridges can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    try:
        NetnsCluster(hosts=1).close()
    except (OSError, RuntimeError, ValueError) as e:
        return f"cannot make network namespaces here: {e}"
    return None

