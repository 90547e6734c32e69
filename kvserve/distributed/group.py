"""The process group of one tensor parallel engine: a TCP store on loopback and two torch.distributed
backends over it, `compute` (activations: gloo on CPU, NCCL on CUDA; collectives time out) and
`control` (gloo: rank 0's step messages; the others wait for the next step as long as it takes).

The backends are made directly, not through init_process_group, so one Python process can hold
several engines' groups one after another without global state.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
CONTROL_TIMEOUT = timedelta(days=30)  # ranks > 0 wait this long for rank 0's next step


def leader_store(size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's store on a free loopback port (`.port`); the other ranks connect to it."""
    return dist.TCPStore(HOST, 0, size, True, timedelta(seconds=timeout), wait_for_workers=False)


def follower_store(port: int, size: int, timeout: float) -> dist.TCPStore:
    """A connection to rank 0's store."""
    return dist.TCPStore(HOST, port, size, False, timedelta(seconds=timeout))


class Group:
    """Rank `rank` of `size`: all_reduce over `compute`, broadcast_object over `control`."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: float):
        self.rank, self.size = rank, size
        self.compute = _backend(dist.PrefixStore("compute", store), rank, size, device, timedelta(seconds=timeout))
        self.control = _gloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)

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


def _backend(store, rank: int, size: int, device: torch.device, timeout: timedelta):
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return _gloo(store, rank, size, timeout)


def _gloo(store, rank: int, size: int, timeout: timedelta):
    """A gloo backend on the loopback interface."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(store, rank, size, opts)
