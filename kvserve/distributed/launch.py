"""Tensor parallel over several hosts, in torchrun's shape. Node 0 runs the engine: rank 0 and its local
ranks (`LLM(..., tensor_parallel_size=N, nnodes=K, node_rank=0, master_addr=A, master_port=P)`); every
other node runs `kvserve tp-node --nnodes K --node-rank I --master-addr A --master-port P`, which connects
to rank 0's store at A:P, takes the engine config rank 0 published there, starts that node's ranks and
holds them until rank 0 stops them.

What the nodes tell each other goes through rank 0's store (keys under kvserve/): `config` (the pickled
EngineConfig, from node 0), `joined/RANK` (a rank's address, set when it connects), `beat/NODE` (a
follower node's heartbeat, a counter its tp-node bumps every HEARTBEAT_S), `exits` and `exit/RANK` (a rank
that exited on a follower node, as its tp-node saw it), `stop` (why rank 0 stopped the other nodes; empty
when it closed cleanly) and `done/NODE` (a follower node whose ranks all exited cleanly).
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from kvserve.config import check_nodes
from kvserve.distributed.group import LOOPBACK, follower_store, node_address

CONFIG = "kvserve/config"
EXITS = "kvserve/exits"
STOP = "kvserve/stop"
HEARTBEAT_S = 0.5   # a follower node's tp-node bumps its beat this often
LOST_AFTER_S = 3.0  # a node whose beat stays still this long is gone (only asked once a collective failed)
CLOSE_GRACE_S = 10.0


def joined_key(rank: int) -> str:
    return f"kvserve/joined/{rank}"


def exit_key(rank: int) -> str:
    return f"kvserve/exit/{rank}"


def beat_key(node: int) -> str:
    return f"kvserve/beat/{node}"


def done_key(node: int) -> str:
    return f"kvserve/done/{node}"


@dataclass(frozen=True)
class Layout:
    """Where the ranks of one tensor parallel engine run: `size` ranks over `nnodes` hosts, node i holding
    ranks i*per_node .. (i+1)*per_node-1, rank 0's store at master_addr:master_port."""

    size: int
    nnodes: int = 1
    master_addr: str = LOOPBACK
    master_port: int = 0

    @classmethod
    def of(cls, config) -> Layout:
        return cls(config.tensor_parallel_size, config.nnodes, config.master_addr, config.master_port)

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    def ranks(self, node: int) -> range:
        """The ranks node `node` runs."""
        return range(node * self.per_node, (node + 1) * self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def command(self, node: int) -> str:
        """What to run on node `node` (> 0)."""
        return (f"kvserve tp-node --nnodes {self.nnodes} --node-rank {node} --master-addr {self.master_addr} "
                f"--master-port {self.master_port}")


def span(ranks) -> str:
    """'rank 3' or 'ranks 2..3'."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}..{ranks[-1]}"


def spawn_rank(rank: int, size: int, port: int, error_file: str, config) -> subprocess.Popen:
    """Start worker rank `rank` (`python -m kvserve.distributed.worker`), `config` pickled on its stdin."""
    args = [sys.executable, "-m", "kvserve.distributed.worker", str(rank), str(size), str(port), error_file]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()
    return proc


def describe_exit(rank: int, proc: subprocess.Popen, error_file: str, where: str = "") -> str:
    """'rank R (pid P[ on HOST]) exited with status S: the last line of its traceback'."""
    text = f"rank {rank} (pid {proc.pid}{where}) exited with status {proc.returncode}"
    if os.path.exists(error_file):
        with open(error_file) as f:
            lines = f.read().strip().splitlines()
        if lines:
            text += ": " + lines[-1]
    return text


def stop_procs(procs: list[subprocess.Popen], wait: float = 5.0) -> None:
    """Wait up to `wait` s for the workers to exit, then kill them."""
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def never_joined(store, ranks) -> list[int]:
    """The ranks of `ranks` that have not connected to rank 0's store."""
    return [r for r in ranks if not store.check([joined_key(r)])]


class RemoteNodes:
    """Rank 0's view, through its store, of the ranks on the other nodes (there are none on one host)."""

    def __init__(self, store, layout: Layout, config):
        self.store, self.layout = store, layout
        self.nodes = range(1, layout.nnodes)
        if self.nodes:
            store.set(CONFIG, pickle.dumps(config))

    def exited(self) -> dict[int, str]:
        """What the follower nodes reported of their ranks that exited (one store round trip when none)."""
        if not self.nodes or int(self.store.add(EXITS, 0)) == 0:
            return {}
        keys = {r: exit_key(r) for r in range(self.layout.per_node, self.layout.size)}
        return {r: self.store.get(k).decode() for r, k in keys.items() if self.store.check([k])}

    def lost(self, wait: float = LOST_AFTER_S) -> list[str]:
        """The remote ranks known gone: those reported exited, and those of each node whose heartbeat stays
        still for `wait` s (a node that never connected is left out: it never joined)."""
        still = {n: b for n in self.nodes if (b := self._beat(n)) > 0}
        deadline = time.monotonic() + wait
        while True:
            reports = self.exited()
            reported = {self.layout.node_of(r) for r in reports}
            still = {n: b for n, b in still.items() if n not in reported and self._beat(n) == b}
            if not still or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return list(reports.values()) + [self._silent(n, wait) for n in still]

    def _beat(self, node: int) -> int:
        return int(self.store.add(beat_key(node), 0))

    def _silent(self, node: int, wait: float) -> str:
        ranks = self.layout.ranks(node)
        key = joined_key(ranks[0])
        where = f" ({self.store.get(key).decode()})" if self.store.check([key]) else ""
        return (f"{span(ranks)} on node {node}{where} lost: its `kvserve tp-node` sent no heartbeat for "
                f"{wait:g} s (the host, its network or the process is gone)")

    def stop(self, reason: str) -> None:
        """Tell the follower nodes to stop: `reason` why, or "" after a clean close (their ranks exit by themselves)."""
        if self.nodes:
            self.store.set(STOP, reason)

    def wait_done(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every follower node to report its ranks exited cleanly."""
        deadline = time.monotonic() + timeout
        keys = [done_key(n) for n in self.nodes]
        while keys and not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


class LeaderLink:
    """A follower node's line to rank 0's store, on a thread of its own: it bumps the node's heartbeat,
    reads rank 0's stop word and sends what the node reports. Off the watching thread because a store call
    to a host that vanished without closing its sockets blocks for as long as TCP retries."""

    def __init__(self, store, node: int):
        self.store, self.node = store, node
        self.answered = time.monotonic()          # when rank 0's store last answered
        self.stop: str | None = None              # rank 0's stop word, once it said one
        self.error: Exception | None = None       # why the store stopped answering, once it did
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="kvserve-tp-node-link").start()

    def _run(self) -> None:
        while True:
            try:
                while not self._ops.empty():
                    self._ops.get()(self.store)
                self.store.add(beat_key(self.node), 1)
                if self.store.check([STOP]):
                    self.stop = self.store.get(STOP).decode()
                self.answered = time.monotonic()
            except RuntimeError as exc:
                self.error = exc
                return
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()

    def send(self, op, wait: float) -> bool:
        """Run `op(store)` on the link's thread; True once rank 0's store answered it (within `wait` s)."""
        asked = time.monotonic()
        self._ops.put(op)
        self._wake.set()
        return self.answer_since(asked, wait)

    def answer_since(self, moment: float, wait: float) -> bool:
        """Whether rank 0's store answers after `moment`, waiting up to `wait` s for it."""
        deadline = time.monotonic() + wait
        self._wake.set()
        while self.answered <= moment and self.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.answered > moment


class NodeAgent:
    """`kvserve tp-node`: node `node`'s ranks, started from the config rank 0 published, watched until rank
    0 stops them. Exits 0 when they all exited cleanly (rank 0 closed the engine), 1 otherwise: a rank of
    its own failed (rank 0 is told), rank 0 stopped the engine, or rank 0's store went away or stayed
    silent for tensor_parallel_timeout seconds."""

    def __init__(self, store, layout: Layout, node: int, config):
        self.layout, self.node, self.config = layout, node, config
        self.link = LeaderLink(store, node)
        self.address = node_address(layout.master_addr, layout.nnodes)
        self.ranks = layout.ranks(node)
        self.errors = tempfile.mkdtemp(prefix="kvserve-tp-node-")
        self.procs: dict[int, subprocess.Popen] = {}

    def run(self) -> int:
        """Start this node's ranks and watch them and rank 0 until the engine ends."""
        say(f"node {self.node} of {self.layout.nnodes} at {self.address}: {span(self.ranks)} of "
            f"{self.layout.size}, rank 0's store at {self.layout.master_addr}:{self.layout.master_port}")
        try:
            self.procs = {r: spawn_rank(r, self.layout.size, self.layout.master_port, self._error_file(r),
                                        self.config) for r in self.ranks}
            return self._watch()
        finally:
            stop_procs(list(self.procs.values()), 0.0)
            shutil.rmtree(self.errors, ignore_errors=True)

    def _error_file(self, rank: int) -> str:
        return os.path.join(self.errors, f"rank{rank}.txt")

    def _watch(self) -> int:
        link, timeout, closing = self.link, self.config.tensor_parallel_timeout, None
        while True:
            codes = [p.poll() for p in self.procs.values()]
            if any(c not in (None, 0) for c in codes):
                return self._rank_exited()
            if all(c == 0 for c in codes):
                return self._closed()
            if link.error is not None:
                return self._leader_gone(str(link.error).splitlines()[0][:200])
            if time.monotonic() - link.answered > timeout:
                return self._leader_gone(f"no answer for {timeout:g} s")
            if link.stop:
                say(f"rank 0 stopped {span(self.ranks)}: {link.stop}")
                return 1
            if link.stop == "":
                closing = closing or time.monotonic()
                if time.monotonic() - closing > CLOSE_GRACE_S:
                    say(f"rank 0 closed the engine but {span(self.ranks)} did not exit in {CLOSE_GRACE_S:g} s")
                    return 1
            time.sleep(0.05)

    def _closed(self) -> int:
        self.link.send(lambda store: store.set(done_key(self.node), "1"), 2.0)
        say(f"{span(self.ranks)} exited cleanly: rank 0 closed the engine")
        return 0

    def _rank_exited(self) -> int:
        """A rank of this node exited with an error: rank 0 is told, unless rank 0 is what went away (its
        ranks' sockets close with it)."""
        if not self.link.answer_since(time.monotonic(), 2 * HEARTBEAT_S + 1.0):
            return self._leader_gone(str(self.link.error or "no answer").splitlines()[0][:200])
        failed = {r: describe_exit(r, p, self._error_file(r), f" on {self.address}")
                  for r, p in self.procs.items() if p.poll() not in (None, 0)}

        def report(store):
            for r, text in failed.items():
                store.set(exit_key(r), text)
            store.add(EXITS, 1)
        self.link.send(report, 2.0)
        say("; ".join(failed.values()) + f"; the other ranks of node {self.node} are stopped")
        return 1

    def _leader_gone(self, why: str) -> int:
        """Rank 0's store stopped answering: rank 0 ended (cleanly, if this node's ranks now exit 0) or died."""
        deadline = time.monotonic() + 2.0
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if all(p.poll() == 0 for p in self.procs.values()):
            say(f"{span(self.ranks)} exited cleanly: rank 0 closed the engine")
            return 0
        say(f"lost rank 0: its store at {self.layout.master_addr}:{self.layout.master_port} stopped answering "
            f"({why}); rank 0's process or host is gone. Stopping {span(self.ranks)}")
        return 1


def say(text: str) -> None:
    print(f"kvserve tp-node: {text}", file=sys.stderr, flush=True)


def connect(args):
    """The store of rank 0 at --master-addr:--master-port, and the engine config rank 0 published there."""
    try:
        store = follower_store(args.master_addr, args.master_port, args.connect_timeout)
        config = pickle.loads(store.get(CONFIG))
    except RuntimeError as exc:
        raise ConnectionError(f"no engine answered at {args.master_addr}:{args.master_port} within "
                              f"{args.connect_timeout:g} s ({str(exc).splitlines()[0][:200]}): start node 0's "
                              "engine with the same --nnodes/--master-addr/--master-port, and check that this "
                              "host reaches that address") from exc
    return store, config


def check_leader(args, config, store) -> None:
    """ValueError (also reported to rank 0) when this node's flags disagree with the engine's config."""
    bad = []
    if config.nnodes != args.nnodes:
        bad.append(f"--nnodes {args.nnodes} but the engine runs on nnodes={config.nnodes}")
    if args.tensor_parallel_size not in (None, config.tensor_parallel_size):
        bad.append(f"--tensor-parallel-size {args.tensor_parallel_size} but the engine's is "
                   f"{config.tensor_parallel_size}")
    if not bad:
        return
    text = f"node {args.node_rank} refused the engine: {'; '.join(bad)}"
    layout = Layout.of(config)
    if args.node_rank < config.nnodes:
        for r in layout.ranks(args.node_rank):
            store.set(exit_key(r), text)
        store.add(EXITS, 1)
    raise ValueError(text + ": give this node the engine's values")


def cmd_tp_node(args) -> int:
    """Run this node's tensor parallel ranks for the engine on node 0."""
    check_nodes(args.nnodes, args.node_rank, args.master_port, args.tensor_parallel_size)
    if args.node_rank == 0:
        raise ValueError("node 0 runs the engine itself (LLM(..., nnodes=N, node_rank=0, master_addr=..., "
                         "master_port=...) or `kvserve serve|generate ... --nnodes N --master-addr A "
                         "--master-port P`); `kvserve tp-node` runs on nodes 1..N-1")
    try:
        store, config = connect(args)
    except ConnectionError as exc:
        say(str(exc))
        return 1
    check_leader(args, config, store)
    store.set_timeout(timedelta(seconds=config.tensor_parallel_timeout))
    return NodeAgent(store, Layout.of(config), args.node_rank, config).run()


def register(sub) -> None:
    """The `kvserve tp-node` subcommand."""
    p = sub.add_parser("tp-node", help="run this host's tensor parallel ranks for an engine on node 0 "
                       "(a multi-host launch, as torchrun's)")
    p.add_argument("--nnodes", type=int, required=True, help="hosts the engine runs on (as node 0's --nnodes)")
    p.add_argument("--node-rank", type=int, required=True, help="this host's place, 1..nnodes-1")
    p.add_argument("--master-addr", required=True, help="node 0's address (its --master-addr)")
    p.add_argument("--master-port", type=int, required=True, help="node 0's store port (its --master-port)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="checked against the engine's (the engine's config is taken from node 0)")
    p.add_argument("--connect-timeout", type=float, default=300.0,
                   help="seconds to wait for node 0's engine to come up")
    p.set_defaults(func=cmd_tp_node)
