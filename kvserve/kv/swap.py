"""Swap space: a host-memory block pool that holds a preempted request's KV until it resumes.

The host pool mirrors every tensor of every storage slot ([num_blocks, block_size, ...], scales
included, whatever the KV format), pinned when the device is CUDA so copies can use DMA. A
request swaps out by copying the blocks that hold its computed tokens to host blocks and freeing
its device blocks; it swaps in by taking fresh device blocks (new ids, new block tables) and
copying the data back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage, _raw

DEFAULT_COPY_BYTES_PER_S = {"cuda": 10e9, "cpu": 5e9}  # priors until a copy has been timed


@dataclass
class _Swapped:
    layout: list[list[bool]]   # per group, per block position: True = a block, False = the null block
    host_ids: list[int]        # host blocks, in layout order (group by group, position by position)
    num_tokens: int
    partial: list[int]         # indices into host_ids of still-filling blocks (they carry `residual`)
    residual: object = None    # KIVI rows of those blocks (storage.export_residual), on the host


class SwapSpace:
    """Host blocks for swapped-out requests, with the copy counters the engine reports."""

    def __init__(self, storage: KVStorage, kv: KVCacheManager, num_blocks: int):
        self.storage = storage
        self.kv = kv
        self.num_blocks = num_blocks
        device = storage.block_tensors()[0].device
        pin = device.type == "cuda"
        self.tensors = [torch.empty((num_blocks, *shape), dtype=dtype, pin_memory=pin)
                        for dtype, shape in storage.block_layout()]
        self.bytes_per_block = storage.bytes_per_block
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.held: dict[str, _Swapped] = {}
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.copy_bytes_per_s = DEFAULT_COPY_BYTES_PER_S.get(device.type, 5e9)

    # ---- queries ---------------------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        """Bytes of host blocks holding swapped-out KV."""
        return (self.num_blocks - len(self.free_ids)) * self.bytes_per_block

    def is_swapped(self, req_id: str) -> bool:
        """True while the request's KV sits in host memory."""
        return req_id in self.held

    def blocks_to_swap(self, req_id: str, num_tokens: int) -> int:
        """Blocks a swap-out of the request's first `num_tokens` tokens would copy."""
        return sum(1 for t in self.kv.swap_out_tables(req_id, num_tokens) for b in t if b != self.kv.null)

    def estimate_seconds(self, num_blocks: int) -> float:
        """Time to copy `num_blocks` out and back at the measured (or prior) bandwidth."""
        return 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    # ---- moves -----------------------------------------------------------------------------
    def swap_out(self, req_id: str, num_tokens: int) -> bool:
        """Copy the request's blocks to host memory and free them on the device; False if full."""
        tables = self.kv.swap_out_tables(req_id, num_tokens)
        layout = [[b != self.kv.null for b in t] for t in tables]
        device_ids = [b for t in tables for b in t if b != self.kv.null]
        if len(device_ids) > len(self.free_ids):
            return False
        host_ids = [self.free_ids.pop() for _ in device_ids]
        partial = self._partial(layout, num_tokens)
        residual = None
        if device_ids:
            t0 = time.perf_counter()
            idx = torch.tensor(host_ids, dtype=torch.long)
            for host, rows in zip(self.tensors, self.storage.read_blocks(device_ids)):
                _raw(host).index_copy_(0, idx, _raw(rows.to("cpu")))
            if partial:  # full blocks are wholly in the block tensors; a filling one may have a row
                residual = _to_host(self.storage.export_residual([device_ids[i] for i in partial]))
            self._observe(len(device_ids), time.perf_counter() - t0)
        self.kv.free(req_id)
        self.held[req_id] = _Swapped(layout, host_ids, num_tokens, partial, residual)
        self.num_swapped_out_blocks += len(device_ids)
        return True

    def swap_in(self, req_id: str, grow: Callable[[], bool]) -> bool:
        """Give the request fresh device blocks, run `grow` (room for its next tokens), copy back.

        False, and nothing changed but evictions, when the pool is short for either.
        """
        rec = self.held[req_id]
        tables = self.kv.allocate_restored(req_id, rec.layout)
        if tables is None:
            return False
        device_ids = [b for t in tables for b in t if b != self.kv.null]  # before grow() extends the tables
        if not grow():
            self.kv.free(req_id)
            return False
        if device_ids:
            t0 = time.perf_counter()
            self.storage.copy_blocks(self.kv.take_pending_copies())  # copies read before we overwrite
            idx = torch.tensor(rec.host_ids, dtype=torch.long)
            self.storage.write_blocks(device_ids, [_raw(h).index_select(0, idx).view(h.dtype) for h in self.tensors])
            if rec.partial:
                self.storage.import_residual([device_ids[i] for i in rec.partial], rec.residual)
            self._observe(len(device_ids), time.perf_counter() - t0)
        self.drop(req_id)
        self.num_swapped_in_blocks += len(device_ids)
        return True

    def drop(self, req_id: str) -> None:
        """Forget a swapped request's host blocks (it resumed, finished or was aborted)."""
        rec = self.held.pop(req_id, None)
        if rec is not None:
            self.free_ids.extend(reversed(rec.host_ids))

    def _partial(self, layout: list[list[bool]], num_tokens: int) -> list[int]:
        """Positions (in host/device id order) of the still-filling last block of each group."""
        bs = self.kv.block_size
        out, n = [], 0
        for g in layout:
            for i, used in enumerate(g):
                if used:
                    if num_tokens % bs and i == num_tokens // bs:
                        out.append(n)
                    n += 1
        return out

    def _observe(self, num_blocks: int, seconds: float) -> None:
        if seconds > 0:
            rate = num_blocks * self.bytes_per_block / seconds
            self.copy_bytes_per_s = 0.8 * self.copy_bytes_per_s + 0.2 * rate


def _to_host(residual):
    """storage.export_residual's (has_row, per slot per entry tensors or None), moved to the CPU."""
    if residual is None:
        return None
    has, data = residual
    return has.cpu(), [[None if t is None else t.cpu() for t in slot] for slot in data]
