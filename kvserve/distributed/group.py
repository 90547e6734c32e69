"""The process group of one tensor parallel engine: rank 0's TCP store (reached on loopback on one host,
at master_addr:master_port over several) and two torch.distributed backends over it, `compute`
(activations: gloo on CPU, NCCL on CUDA; collectives time out) and `control` (gloo: rank 0's step
messages; the others wait for the next step as long as it takes). Gloo's pairs listen on each rank's
node_address: loopback on one host, else the address its peers reach it at.

The backends are made directly, not through init_process_group, so one Python process can hold
several engines' groups one after another without global state.
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
CONTROL_TIMEOUT = timedelta(days=30)  # ranks > 0 wait this long for rank 0's next step


def leader_store(size: int, timeout: float, host: str = LOOPBACK, port: int = 0) -> dist.TCPStore:
    """Rank 0's store at `host`:`port` (0: a free port, read `.port`); the other ranks connect to it.
    The server listens on every interface of this host; `host` is where its own client connects."""
    try:
        return dist.TCPStore(host, port, size, True, timedelta(seconds=timeout), wait_for_workers=False)
    except RuntimeError as exc:
        raise RuntimeError(f"rank 0's store cannot listen on {host}:{port} ({str(exc).splitlines()[0][:200]}): "
                           "give a free master_port") from exc


def follower_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A connection to rank 0's store at `host`:`port` (retried until `timeout` s while it is not up yet)."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))


def node_address(master_addr: str, nnodes: int) -> str:
    """The address the other ranks reach this one at: loopback on one host; over several, the address of
    this host's interface that routes to `master_addr` (a UDP connect() picks it and sends nothing)."""
    if nnodes == 1:
        return LOOPBACK
    family, kind, proto, _, addr = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return s.getsockname()[0]


class Group:
    """Rank `rank` of `size`: all_reduce over `compute`, broadcast_object over `control`; gloo's pairs
    listen on `host` (node_address)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: float,
                 host: str = LOOPBACK):
        self.rank, self.size = rank, size
        self.compute = _backend(dist.PrefixStore("compute", store), rank, size, device,
                                timedelta(seconds=timeout), host)
        # rank 0 never waits longer than `timeout`; the others wait for its next step as long as it takes
        control_timeout = timedelta(seconds=timeout) if rank == 0 else CONTROL_TIMEOUT
        self.control = _gloo(dist.PrefixStore("control", store), rank, size, control_timeout, host)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        self.compute.allreduce([t]).wait()

    def min(self, value: int) -> int:
        """The smallest `value` of all ranks."""
        t = torch.tensor([value], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled; tensors in it must be on the CPU)."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.long)
        self._broadcast(n)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(n.item()), dtype=torch.uint8)
        self._broadcast(buf)
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.control.broadcast([t], opts).wait()


def _backend(store, rank: int, size: int, device: torch.device, timeout: timedelta, host: str):
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return _gloo(store, rank, size, timeout, host)


def _gloo(store, rank: int, size: int, timeout: timedelta, host: str):
    """A gloo backend whose pairs listen on `host`."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)
