"""Block ids, reference counts, an LRU queue of free blocks, and the hash -> block map."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv.block_stats import TimeHistogram
from kvserve.kv.hashing import BlockHash


@dataclass
class Block:
    """One physical block of `block_size` token slots."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash to guard against collisions
    allocated_at: float = 0.0                  # clock time of its latest allocation
    freed_at: float = 0.0                      # clock time its ref count last fell to 0


class BlockPool:
    """Hands out blocks; freed blocks keep their hash until reallocated (LRU order)."""

    def __init__(self, num_blocks: int, reserved: int = 0):
        if num_blocks - reserved < 1:
            raise ValueError(f"num_blocks must leave >= 1 usable block, got {num_blocks} ({reserved} reserved)")
        self.num_blocks = num_blocks
        self.reserved = reserved  # leading block ids never handed out (e.g. the null block)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front of the queue is reused first: blocks without a hash go to the front,
        # freed cached blocks to the back (least recently used are reused first).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(reserved, num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.num_evicted = 0
        # Called with the cached blocks a reuse is about to overwrite, while their memory still
        # holds the data: [(block_id, block_hash, token_ids)] (the tiers write them down).
        self.on_evict: Callable[[list[tuple[int, BlockHash, tuple[int, ...]]]], None] | None = None
        # Called with each block newly registered under a hash (write-through tiers store it).
        self.on_register: Callable[[int, BlockHash, tuple[int, ...]], None] | None = None
        # Block timings: lifetime = allocation until its contents are dropped (freed without a hash,
        # or evicted while cached); reuse gap = freed until a prefix hit takes it again (KVCacheManager).
        self.clock: Callable[[], float] = time.monotonic
        self.lifetime = TimeHistogram()
        self.reuse_gap = TimeHistogram()

    @property
    def num_usable(self) -> int:
        """Blocks that can be handed out."""
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        """Blocks with no owner (cached ones included)."""
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable hash."""
        return sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the hash map (owned or free)."""
        return len(self.cached)

    def allocate(self, n: int) -> list[Block]:
        """Take `n` blocks from the front of the free queue (evicting their hashes)."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free} free")
        out, evicted = [], []
        now = self.clock() if n else 0.0
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None and self.on_evict is not None:
                evicted.append((block_id, block.block_hash, block.token_ids))
            self._forget_hash(block, now)
            block.ref_cnt = 1
            block.allocated_at = now
            out.append(block)
        if evicted:
            self.on_evict(evicted)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks (reviving free cached blocks from the queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int], stamp: bool = True) -> None:
        """Drop a reference on each block; give the order tail-first for LRU eviction.

        `stamp=False` keeps the blocks' free time (a reference taken and given back at once)."""
        now = self.clock() if block_ids else 0.0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                if stamp:
                    block.freed_at = now
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
                    self.lifetime.observe(now - block.allocated_at)  # nothing reusable left in it

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """Block id holding exactly these tokens under this hash, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def register(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Mark a full block as cached under `block_hash` (first writer wins)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block_id
        if self.on_register is not None:
            self.on_register(block_id, block_hash, token_ids)

    def reset_cache(self, offload: bool = False) -> int:
        """Forget every hash of free blocks (handing them to `on_evict` first if `offload`)."""
        dropped = [(b, self.blocks[b].block_hash, self.blocks[b].token_ids) for b in self.free_queue
                   if self.blocks[b].block_hash is not None]
        if offload and dropped and self.on_evict is not None:
            self.on_evict(dropped)
        now = self.clock()
        for block_id, _, _ in dropped:
            self._forget_hash(self.blocks[block_id], now)
        return len(dropped)

    def _forget_hash(self, block: Block, now: float) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            self.num_evicted += 1
            self.lifetime.observe(now - block.allocated_at)
        block.block_hash = None
        block.token_ids = None
