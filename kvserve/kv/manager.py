"""KVCacheManager: per-request block tables (one per KV group) over one shared BlockPool."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import BlockHash, hash_full_blocks
from kvserve.kv.spec import KVGroup, KVSpec, first_needed_block

NULL_BLOCK = 0  # with sliding groups, block 0 is reserved to stand in for freed window blocks


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens as vLLM does."""

    queries: int = 0
    hits: int = 0


@dataclass
class _ReqState:
    tables: list[list[int]]                                       # block ids per group
    block_hashes: list[BlockHash] = field(default_factory=list)  # token chain, shared by groups
    num_registered: int = 0   # leading blocks already offered to the hash map (all groups)


class KVCacheManager:
    """Maps each request to its block tables and keeps the pool consistent."""

    def __init__(self, num_blocks: int, block_size: int, namespace: BlockHash,
                 enable_prefix_caching: bool = True, groups: list[KVGroup] | None = None):
        self.block_size = block_size
        self.groups = groups or [KVGroup(KVSpec("full"), [])]
        self.has_sliding = any(g.spec.kind == "sliding" for g in self.groups)
        self.pool = BlockPool(num_blocks, reserved=1 if self.has_sliding else 0)
        self.null = NULL_BLOCK if self.has_sliding else -1
        self.namespace = namespace
        self.enable_prefix_caching = enable_prefix_caching
        self.reqs: dict[str, _ReqState] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copies to run before the next forward
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Usable blocks in the pool."""
        return self.pool.num_usable

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """The request's block table for one group."""
        return self.reqs[req_id].tables[group]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens occupies in one group."""
        return -(-num_tokens // self.block_size)

    def max_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a lone sequence of `num_tokens` tokens holds at most, over all groups."""
        total = 0
        for g in self.groups:
            n = self.blocks_for_tokens(num_tokens)
            if g.spec.kind == "sliding":
                n = min(n, self.blocks_for_tokens(g.spec.window) + 1)
            total += n
        return total

    def usage(self) -> float:
        """Fraction of usable blocks owned by some request (0-1)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int]) -> tuple[list[list[int]], int]:
        """Cached blocks per group for the longest usable prefix; the last token is never a hit."""
        state = self._state(req_id)
        empty = [[] for _ in self.groups]
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return empty, 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(state, token_ids, max_blocks)
        found = [self._lookup_all(g, state, token_ids, max_blocks) for g in range(len(self.groups))]
        for h in range(self._full_run(found, max_blocks), 0, -1):
            hits = self._hits_at(found, h)
            if hits is not None:
                return hits, h * self.block_size
        return empty, 0

    def _lookup_all(self, g: int, state: _ReqState, token_ids: list[int], n: int) -> list[int | None]:
        bs = self.block_size
        return [self.pool.lookup(self._key(g, state.block_hashes[i]), tuple(token_ids[i * bs:(i + 1) * bs]))
                for i in range(n)]

    def _full_run(self, found: list[list[int | None]], n: int) -> int:
        run = n
        for g, blocks in enumerate(found):
            if self.groups[g].spec.kind != "sliding":
                run = min(run, next((i for i, b in enumerate(blocks) if b is None), n))
        return run

    def _hits_at(self, found, h: int) -> list[list[int]] | None:
        out = []
        for g, blocks in enumerate(found):
            start = first_needed_block(self.groups[g].spec, h * self.block_size, self.block_size)
            tail = blocks[start:h]
            if any(b is None for b in tail):
                return None
            out.append([self.null] * start + tail)
        return out

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def reset_prefix_cache(self) -> int:
        """Forget hashes of all free blocks (owned blocks keep theirs)."""
        return self.pool.reset_cache()

    # ---- allocation ----------------------------------------------------------------
    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: list[list[int]] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        state = self._state(req_id)
        computed = new_computed_blocks or [[] for _ in self.groups]
        self._free_skipped(state, num_computed_tokens)
        total = num_computed_tokens + num_new_tokens
        needs, cows, revived = [], [], 0
        for g, table in enumerate(state.tables):
            needs.append(max(0, self.blocks_for_tokens(total) - len(table) - len(computed[g])))
            cows.append(self._needs_copy(table, num_computed_tokens, num_new_tokens))
            revived += sum(1 for b in set(computed[g]) if b != self.null and self.pool.blocks[b].ref_cnt == 0)
        if sum(needs) + sum(cows) + revived > self.pool.num_free:
            return False
        for g, table in enumerate(state.tables):
            if computed[g]:
                self.pool.touch([b for b in computed[g] if b != self.null])
                table.extend(computed[g])
            if cows[g]:
                self._copy_on_write(table, num_computed_tokens // self.block_size)
            table.extend(b.block_id for b in self.pool.allocate(needs[g]))
        if any(computed):
            state.num_registered = max(len(c) for c in computed)
        return True

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's newly full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        state = self.reqs[req_id]
        num_full = num_computed_tokens // self.block_size
        if num_full <= state.num_registered:
            return
        self._extend_hashes(state, token_ids, num_full)
        bs = self.block_size
        for i in range(state.num_registered, num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            for g, table in enumerate(state.tables):
                if i < len(table) and table[i] != self.null:
                    self.pool.register(table[i], self._key(g, state.block_hashes[i]), tokens)
        state.num_registered = num_full

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first so tails are evicted first."""
        state = self.reqs.pop(req_id, None)
        if state is not None:
            for table in state.tables:
                self.pool.free([b for b in reversed(table) if b != self.null])

    def fork(self, src_id: str, dst_id: str) -> None:
        """Give `dst_id` the same blocks as `src_id` (shared; copied on write)."""
        src = self.reqs[src_id]
        if dst_id in self.reqs:
            raise ValueError(f"request {dst_id!r} already holds blocks")
        for table in src.tables:
            self.pool.touch([b for b in table if b != self.null])
        self.reqs[dst_id] = _ReqState([list(t) for t in src.tables], list(src.block_hashes), src.num_registered)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) the storage must run before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- helpers -------------------------------------------------------------------
    def _state(self, req_id: str) -> _ReqState:
        if req_id not in self.reqs:
            self.reqs[req_id] = _ReqState([[] for _ in self.groups])
        return self.reqs[req_id]

    def _key(self, group: int, block_hash: BlockHash) -> BlockHash:
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def _extend_hashes(self, state: _ReqState, token_ids: list[int], num_blocks: int) -> None:
        have = len(state.block_hashes)
        if num_blocks > have:
            parent = state.block_hashes[-1] if have else None
            state.block_hashes.extend(
                hash_full_blocks(self.namespace, token_ids[:num_blocks * self.block_size],
                                 self.block_size, start_block=have, parent=parent))

    def _free_skipped(self, state: _ReqState, num_computed: int) -> None:
        """Sliding groups drop blocks wholly outside the window of every future query."""
        for g, table in enumerate(state.tables):
            end = min(first_needed_block(self.groups[g].spec, num_computed, self.block_size), len(table))
            dropped = [b for b in table[:end] if b != self.null]
            if dropped:
                self.pool.free(dropped)
                table[:end] = [self.null] * end

    def _needs_copy(self, table: list[int], num_computed: int, num_new: int) -> bool:
        index = num_computed // self.block_size
        partial = num_computed % self.block_size != 0
        return (num_new > 0 and partial and index < len(table) and table[index] != self.null
                and self.pool.blocks[table[index]].ref_cnt > 1)

    def _copy_on_write(self, table: list[int], index: int) -> None:
        old = table[index]
        new = self.pool.allocate(1)[0].block_id
        self.pending_copies.append((old, new))
        self.num_cow_copies += 1
        self.pool.free([old])
        table[index] = new
