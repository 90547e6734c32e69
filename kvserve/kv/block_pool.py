"""Block ids, reference counts, an LRU queue of free blocks, and the hash -> block map.

Retention pins (`pin`) keep chosen cached blocks the longest: a free pinned block waits outside
the LRU queue, in a queue per priority, and is reused only when no unpinned free block is left
(lowest priority first, least recently used first within a priority). A pin is a priority, not a
reservation: it never makes an allocation fail. Pins expire lazily (a heap of expiry times is
checked when blocks are allocated or pinned); an expired pin's block rejoins the LRU queue at the
tail, as if freed then. At most `pin_limit` blocks are pinned at once; pins beyond it are refused.

The pool calls no one. What happens to its cached blocks (a block stored under a hash, cached blocks
evicted for reuse, a block pinned, blocks forgotten because a request failed on them) the KV
manager that owns it tells its `BlockPoolListener`s: the pool's methods return or fill in what they
did (`allocate(n, evicted)`, `register`, `pin`, `forget`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv.block_stats import TimeHistogram
from kvserve.kv.hashing import BlockHash

Evicted = list[tuple[int, BlockHash, tuple[int, ...]]]  # (block id, pool key, token ids) per block


class BlockPoolListener:
    """What a KV manager reports about its pool's cached blocks; each method does nothing by default."""

    def stored(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """A full block was registered under `block_hash` (its contents are final)."""

    def evicted(self, blocks: Evicted) -> None:
        """Cached blocks lose their hashes for reuse (or a reset that offloads); their memory still
        holds the data until the caller returns."""

    def pinned(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """A cached block was newly pinned by a retention request."""

    def removed(self, keys: list[BlockHash]) -> None:
        """The blocks under these pool keys are not to be trusted (a request failed on them): the
        device forgot them; forget them everywhere else too, and never write them down."""


@dataclass
class Block:
    """One physical block of `block_size` token slots."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash to guard against collisions
    allocated_at: float = 0.0                  # clock time of its latest allocation
    freed_at: float = 0.0                      # clock time its ref count last fell to 0
    pin_priority: int | None = None            # retention priority while pinned (0-100)
    pin_expires: float = math.inf              # clock time the pin ends


class BlockPool:
    """Hands out blocks; freed blocks keep their hash until reallocated (LRU order)."""

    def __init__(self, num_blocks: int, reserved: int = 0, pin_limit: int = 0):
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
        # Block timings: lifetime = allocation until its contents are dropped (freed without a hash,
        # or evicted while cached); reuse gap = freed until a prefix hit takes it again (KVCacheManager).
        self.clock: Callable[[], float] = time.monotonic
        self.lifetime = TimeHistogram()
        self.reuse_gap = TimeHistogram()
        # Retention pins: free pinned blocks per priority (LRU order), expiry heap, share and counts.
        self.pinned_free: dict[int, OrderedDict[int, None]] = {}
        self.num_pinned_free = 0
        self.num_pinned = 0
        self.pin_limit = pin_limit
        self._expiry: list[tuple[float, int]] = []
        self.pin_counts = {"taken": 0, "refused": 0, "expired": 0, "evicted": 0}

    @property
    def num_usable(self) -> int:
        """Blocks that can be handed out."""
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        """Blocks with no owner (cached and pinned ones included)."""
        return len(self.free_queue) + self.num_pinned_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable hash."""
        return sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None) + self.num_pinned_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the hash map (owned or free)."""
        return len(self.cached)

    def is_free(self, block_id: int) -> bool:
        """True when no request holds the block."""
        return self.blocks[block_id].ref_cnt == 0

    def allocate(self, n: int, evicted: Evicted | None = None) -> list[Block]:
        """Take `n` blocks from the front of the free queue (evicting their hashes); the cached
        blocks among them are appended to `evicted` when it is given."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free} free")
        out = []
        now = self.clock() if n else 0.0
        if n:
            self.expire(now)
        for _ in range(n):
            block_id = self.free_queue.popitem(last=False)[0] if self.free_queue else self._pop_pinned()
            block = self.blocks[block_id]
            if block.block_hash is not None and evicted is not None:
                evicted.append((block_id, block.block_hash, block.token_ids))
            self._forget_hash(block, now)
            block.ref_cnt = 1
            block.allocated_at = now
            out.append(block)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks (reviving free cached blocks from the queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._unqueue(block)
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
                if stamp:
                    block.freed_at = now
                if block.pin_priority is not None:
                    self._queue_pinned(block)
                    continue
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
                    self.lifetime.observe(now - block.allocated_at)  # nothing reusable left in it

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """Block id holding exactly these tokens under this hash, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def register(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Mark a full block as cached under `block_hash` (first writer wins); True if it was."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block_id
        return True

    def reset_cache(self, evicted: Evicted | None = None) -> int:
        """Forget every hash of free blocks, pinned ones too; the blocks are appended to `evicted`
        when it is given. Returns how many hashes were forgotten."""
        for queue in list(self.pinned_free.values()):
            for block_id in list(queue):
                self._unpin(self.blocks[block_id])
        dropped = [(b, self.blocks[b].block_hash, self.blocks[b].token_ids) for b in self.free_queue
                   if self.blocks[b].block_hash is not None]
        if evicted is not None:
            evicted.extend(dropped)
        now = self.clock()
        for block_id, _, _ in dropped:
            self._forget_hash(self.blocks[block_id], now)
        return len(dropped)

    def forget(self, keys: list[BlockHash]) -> list[BlockHash]:
        """Drop these hashes from the cache, owned or free blocks (pinned ones unpinned); a free block
        becomes the next one handed out. Returns the keys that were cached."""
        now, out = self.clock(), []
        for key in keys:
            block_id = self.cached.get(key)
            if block_id is None:
                continue
            block = self.blocks[block_id]
            if block.pin_priority is not None:
                self._unpin(block)
            self._forget_hash(block, now)
            if block.ref_cnt == 0:
                self.free_queue.move_to_end(block_id, last=False)
            out.append(key)
        return out

    def _forget_hash(self, block: Block, now: float) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            self.num_evicted += 1
            self.lifetime.observe(now - block.allocated_at)
        block.block_hash = None
        block.token_ids = None

    # ---- retention pins --------------------------------------------------------------
    def pin(self, block_id: int, priority: int, expires_at: float = math.inf) -> bool:
        """Pin a cached block the caller holds until `expires_at` (a pinned block is raised, never
        lowered); False when the pin share is full (the block stays a plain cached block)."""
        block = self.blocks[block_id]
        if block.block_hash is None or block.ref_cnt == 0:
            raise RuntimeError(f"block {block_id} must be cached and held to be pinned")
        self.expire(self.clock())
        if block.pin_priority is None:
            if self.num_pinned >= self.pin_limit:
                self.pin_counts["refused"] += 1
                return False
            self.num_pinned += 1
            self.pin_counts["taken"] += 1
            block.pin_priority, block.pin_expires = priority, expires_at
        elif expires_at > block.pin_expires or priority > block.pin_priority:
            block.pin_priority = max(block.pin_priority, priority)
            block.pin_expires = max(block.pin_expires, expires_at)
        else:
            return True
        if block.pin_expires < math.inf:
            heapq.heappush(self._expiry, (block.pin_expires, block_id))
        return True

    def expire(self, now: float) -> int:
        """End the pins whose time has come; returns how many ended."""
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            at, block_id = heapq.heappop(self._expiry)
            block = self.blocks[block_id]
            if block.pin_priority is not None and block.pin_expires == at:  # else a stale entry
                self._unpin(block)
                n += 1
        self.pin_counts["expired"] += n
        return n

    def pin_metrics(self) -> dict:
        """Pinned blocks (all, free), the share's bound, and pin counters."""
        return {"kv_pinned_blocks": self.num_pinned, "kv_pinned_blocks_free": self.num_pinned_free,
                "kv_pin_limit_blocks": self.pin_limit,
                **{f"kv_pins_{k}": v for k, v in self.pin_counts.items()}}

    def _unpin(self, block: Block) -> None:
        """Drop the block's pin; a free block moves to the tail of the LRU queue."""
        if block.ref_cnt == 0:
            self._unqueue(block)
            self.free_queue[block.block_id] = None
        block.pin_priority, block.pin_expires = None, math.inf
        self.num_pinned -= 1

    def _queue_pinned(self, block: Block) -> None:
        self.pinned_free.setdefault(block.pin_priority, OrderedDict())[block.block_id] = None
        self.num_pinned_free += 1

    def _unqueue(self, block: Block) -> None:
        """Take a free block out of whichever queue holds it."""
        if block.pin_priority is None:
            del self.free_queue[block.block_id]
            return
        queue = self.pinned_free[block.pin_priority]
        del queue[block.block_id]
        if not queue:
            del self.pinned_free[block.pin_priority]
        self.num_pinned_free -= 1

    def _pop_pinned(self) -> int:
        """The least recently used free block of the lowest pin priority, unpinned (no unpinned one is free)."""
        block_id = next(iter(self.pinned_free[min(self.pinned_free)]))
        block = self.blocks[block_id]
        self._unqueue(block)
        block.pin_priority, block.pin_expires = None, math.inf
        self.num_pinned -= 1
        self.pin_counts["evicted"] += 1
        return block_id
