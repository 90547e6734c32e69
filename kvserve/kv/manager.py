"""KVCacheManager: per-request block tables over one BlockPool, prefix hits, forks (copy-on-write)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import BlockHash, hash_full_blocks


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens as vLLM does."""

    queries: int = 0
    hits: int = 0


@dataclass
class _ReqState:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # hashes of full blocks so far
    num_registered: int = 0  # leading blocks already registered in the pool's hash map


class KVCacheManager:
    """Maps each request to its block table and keeps the pool consistent."""

    def __init__(self, num_blocks: int, block_size: int, namespace: BlockHash,
                 enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.namespace = namespace
        self.enable_prefix_caching = enable_prefix_caching
        self.reqs: dict[str, _ReqState] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies to run before the next forward
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table."""
        return self.reqs[req_id].block_ids

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens occupies."""
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        """Fraction of blocks owned by some request (0-1)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int]) -> tuple[list[int], int]:
        """Longest run of cached full blocks for these tokens; the last token is never a hit."""
        state = self.reqs.setdefault(req_id, _ReqState())
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(state, token_ids, max_blocks)
        hits = []
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.pool.lookup(state.block_hashes[i], tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def reset_prefix_cache(self) -> int:
        """Forget hashes of all free blocks (owned blocks keep theirs)."""
        return self.pool.reset_cache()

    # ---- allocation ----------------------------------------------------------------
    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        state = self.reqs.setdefault(req_id, _ReqState())
        computed = new_computed_blocks or []
        total_tokens = num_computed_tokens + num_new_tokens
        have = len(state.block_ids) + len(computed)
        need_new = max(0, self.blocks_for_tokens(total_tokens) - have)
        cow = self._needs_copy(state, num_computed_tokens, num_new_tokens)
        revived = sum(1 for b in computed if self.pool.blocks[b].ref_cnt == 0)
        if need_new + int(cow) + revived > self.pool.num_free:
            return False
        if computed:
            self.pool.touch(computed)
            state.block_ids.extend(computed)
            state.num_registered = len(state.block_ids)
        if cow:
            self._copy_on_write(state, num_computed_tokens // self.block_size)
        state.block_ids.extend(b.block_id for b in self.pool.allocate(need_new))
        return True

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's newly full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        state = self.reqs[req_id]
        num_full = min(num_computed_tokens // self.block_size, len(state.block_ids))
        if num_full <= state.num_registered:
            return
        self._extend_hashes(state, token_ids, num_full)
        for i in range(state.num_registered, num_full):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            self.pool.register(state.block_ids[i], state.block_hashes[i], tokens)
        state.num_registered = num_full

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first so tails are evicted first."""
        state = self.reqs.pop(req_id, None)
        if state is not None:
            self.pool.free(list(reversed(state.block_ids)))

    def fork(self, src_id: str, dst_id: str) -> None:
        """Give `dst_id` the same blocks as `src_id` (shared; copied on write)."""
        src = self.reqs[src_id]
        if dst_id in self.reqs:
            raise ValueError(f"request {dst_id!r} already holds blocks")
        self.pool.touch(src.block_ids)
        self.reqs[dst_id] = _ReqState(list(src.block_ids), list(src.block_hashes), src.num_registered)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) the storage must run before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- helpers -------------------------------------------------------------------
    def _extend_hashes(self, state: _ReqState, token_ids: list[int], num_blocks: int) -> None:
        have = len(state.block_hashes)
        if num_blocks > have:
            parent = state.block_hashes[-1] if have else None
            state.block_hashes.extend(
                hash_full_blocks(self.namespace, token_ids[:num_blocks * self.block_size],
                                 self.block_size, start_block=have, parent=parent))

    def _needs_copy(self, state: _ReqState, num_computed: int, num_new: int) -> bool:
        index = num_computed // self.block_size
        partial = num_computed % self.block_size != 0
        return (num_new > 0 and partial and index < len(state.block_ids)
                and self.pool.blocks[state.block_ids[index]].ref_cnt > 1)

    def _copy_on_write(self, state: _ReqState, index: int) -> None:
        old = state.block_ids[index]
        new = self.pool.allocate(1)[0].block_id
        self.pending_copies.append((old, new))
        self.num_cow_copies += 1
        self.pool.free([old])
        state.block_ids[index] = new
