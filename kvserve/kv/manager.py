"""KVCacheManager: per-request block tables (one per KV group) over one shared BlockPool.

Everything the manager works with is handed to it when it is built: the pool (or its size), the
listeners it tells about the pool's cached blocks (kv/block_pool.py `BlockPoolListener`: stored,
evicted, pinned, removed), an optional lower tier (kv/tiers.py `TierBridge`) that extends the prefix cache
below the device (a lookup that misses on the device asks `lower.locate` / `lower.load` to bring
blocks back into fresh device blocks; the bridge is also a listener, which writes blocks down),
the KV events queue (kv/events.py) and a factory of its eviction strategy (kv/eviction.py's
KeepAll by default, kv/evictor.py's Evictor under a kv_policy), which works through the manager's
own methods: block_ids, slots, shared_indices, unshare, release_tail, blocks_held.

A request's cache salt (`set_salt`) goes into its first block's hash, so salted requests share
blocks only with requests of the same salt; the tiers key blocks by the same hashes.

A request with retention (`set_retention`) pins its prompt's full blocks as they are cached
(kv/block_pool.py `pin`): they are evicted last, until the pin expires. Pins hold at most
`pin_fraction` of the pool; the rest are refused (counted, logged at debug) and the request runs as usual.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.kv.block_pool import BlockPool, BlockPoolListener, Evicted
from kvserve.kv.eviction import KeepAll
from kvserve.kv.hashing import DEFAULT_HASH_ALGO, BlockHash, digest_fn, hash_full_blocks, split_key
from kvserve.kv.spec import FullSpec, KVGroup, null_blocks

NULL_BLOCK = 0  # with sliding groups, block 0 is reserved to stand in for freed window blocks
DEFAULT_PIN_FRACTION = 0.5  # share of the pool retention pins may hold

log = logging.getLogger("kvserve")


def new_pool(num_blocks: int, groups: list[KVGroup] | None = None,
             pin_fraction: float = DEFAULT_PIN_FRACTION) -> BlockPool:
    """The pool a KVCacheManager of these groups runs on (the null block reserved for sliding groups)."""
    reserved = null_blocks(groups or [])
    return BlockPool(num_blocks, reserved, pin_limit=int(pin_fraction * (num_blocks - reserved)))


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens as vLLM does."""

    queries: int = 0
    hits: int = 0
    hits_by_source: dict[str, int] = field(default_factory=lambda: {"device": 0})


@dataclass
class _ReqState:
    tables: list[list[int]]                                       # block ids per group
    block_hashes: list[BlockHash] = field(default_factory=list)  # token chain, shared by groups
    num_registered: int = 0   # leading blocks already offered to the hash map (all groups)
    rows: int = 0             # residual rows (KIVI) its latest step needs, see KVCacheManager.residual_rows
    num_pinned: int = 0       # leading blocks already offered to retention pins


@dataclass
class _Retention:
    priority: int
    expires_at: float
    num_blocks: int  # leading full blocks to pin


class KVCacheManager:
    """Maps each request to its block tables and keeps the pool consistent.

    `pool`: the pool to run on (built with `new_pool`; one is built when None). `listeners` are told
    what happens to cached blocks, in order. `lower`: locate / load of blocks below the device.
    `events`: a KVEventQueue for the device's KV events. `eviction`: called with the manager, it
    returns the eviction strategy (KeepAll when None). `residual_rows`: the still-filling blocks a
    KIVI format keeps (None: no limit)."""

    holds_kv = True   # kv/no_cache.py's NoCacheManager answers the same calls holding nothing

    def __init__(self, num_blocks: int, block_size: int, namespace: BlockHash,
                 enable_prefix_caching: bool = True, groups: list[KVGroup] | None = None,
                 hash_algo: str = DEFAULT_HASH_ALGO, pin_fraction: float = DEFAULT_PIN_FRACTION, *,
                 pool: BlockPool | None = None, listeners: Sequence[BlockPoolListener] = (),
                 lower=None, events=None, eviction: Callable[[KVCacheManager], object] | None = None,
                 residual_rows: int | None = None):
        self.block_size = block_size
        self.groups = groups or [KVGroup(FullSpec(), [])]
        self.has_sliding = any(g.spec.keeps_window for g in self.groups)
        self.pool = pool if pool is not None else new_pool(num_blocks, self.groups, pin_fraction)
        if self.pool.num_blocks != num_blocks or self.pool.reserved != null_blocks(self.groups):
            raise ValueError(f"the pool has {self.pool.num_blocks} blocks ({self.pool.reserved} reserved), "
                             f"the manager wants {num_blocks} ({null_blocks(self.groups)} reserved)")
        self.listeners = list(listeners)
        self.retention: dict[str, _Retention] = {}  # req_id -> its pin, for requests with retention
        self.null = NULL_BLOCK if self.has_sliding else -1
        self.namespace = namespace
        digest_fn(hash_algo)  # fails early, saying what to install, when the algorithm is missing
        self.hash_algo = hash_algo
        self.salts: dict[str, str] = {}  # req_id -> cache salt, for salted requests only
        self.enable_prefix_caching = enable_prefix_caching
        self.reqs: dict[str, _ReqState] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copies to run before the next forward
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0
        self.lower = lower                     # TierBridge-like: locate / load (kv/tiers.py)
        self.loaded_from: dict[int, str] = {}  # block id -> tier it was loaded from, until first used
        self.events = events  # KVEventQueue (kv/events.py) when KV events are on
        # KIVI formats keep each still-filling block in one of a fixed number of residual rows
        # (kv/storage.py). `residual_rows`: how many (None: the format keeps none, no limit);
        # `rows_held`: the rows the requests' latest steps need, summed over requests.
        self.residual_rows = residual_rows
        self.rows_held = 0
        # The eviction strategy (kv/eviction.py; kv/evictor.py's Evictor under a kv_policy). An
        # evicting request's group g holds num_computed - offsets[g] entries and publishes no blocks
        # (they would not hold the hashed tokens); hit_limit bounds its prefix-cache hits.
        self.eviction = eviction(self) if eviction is not None else KeepAll()

    # ---- queries -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Usable blocks in the pool."""
        return self.pool.num_usable

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """The request's block table for one group."""
        return self.reqs[req_id].tables[group]

    def has_request(self, req_id: str) -> bool:
        """True while the request holds block tables."""
        return req_id in self.reqs

    def blocks_held(self, req_id: str) -> int:
        """Blocks the request's tables hold over all groups (null entries not counted)."""
        state = self.reqs.get(req_id)
        return 0 if state is None else sum(1 for t in state.tables for b in t if b != self.null)

    def slots(self, req_id: str, group: int, index: torch.Tensor) -> torch.Tensor:
        """Flat storage slot (block id * block_size + offset) of each cache index of the group's table."""
        bs = self.block_size
        table = torch.tensor(self.reqs[req_id].tables[group], dtype=torch.long)
        return table[index // bs] * bs + index % bs

    def is_shared(self, block_id: int) -> bool:
        """True when a write to the block would show elsewhere: another request holds it (a fork)
        or the prefix cache names it."""
        block = self.pool.blocks[block_id]
        return block.ref_cnt > 1 or block.block_hash is not None

    def shared_indices(self, req_id: str, group: int, end: int) -> list[int]:
        """Indices below `end` of the request's table in `group` whose blocks are shared (is_shared)."""
        table = self.reqs[req_id].tables[group]
        return [i for i, b in enumerate(table[:end]) if b != self.null and self.is_shared(b)]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens occupies in one group."""
        return -(-num_tokens // self.block_size)

    def max_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a lone sequence of `num_tokens` tokens holds at most, over all groups."""
        return sum(g.spec.blocks_held(num_tokens, self.block_size) for g in self.groups)

    def usage(self) -> float:
        """Fraction of usable blocks owned by some request (0-1)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int]) -> tuple[list[list[int]], int]:
        """Cached blocks per group for the longest usable prefix; the last token is never a hit."""
        state = self._state(req_id)
        empty = [[] for _ in self.groups]
        limit = self.eviction.hit_limit(req_id)
        if not self.enable_prefix_caching or len(token_ids) < 2 or limit == 0:
            return empty, 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        if limit is not None:
            max_blocks = min(max_blocks, limit // self.block_size)
        self._extend_hashes(req_id, state, token_ids, max_blocks)
        found = [self._lookup_all(g, state, token_ids, max_blocks) for g in range(len(self.groups))]
        if self.lower is not None and self._load_from_lower(state, token_ids, found, max_blocks):
            found = [self._lookup_all(g, state, token_ids, max_blocks) for g in range(len(self.groups))]
        for h in range(self._full_run(found, max_blocks), 0, -1):
            hits = self._hits_at(found, h)
            if hits is not None:
                return hits, h * self.block_size
        return empty, 0

    def transfer_blocks(self, req_id: str, token_ids: list[int]) -> Evicted:
        """(block id, pool key, tokens) of the request's blocks a prefix hit on `token_ids` uses:
        the full blocks before the last token, in every group (a sliding group's still held ones)."""
        state = self._state(req_id)
        bs, n = self.block_size, (len(token_ids) - 1) // self.block_size
        self._extend_hashes(req_id, state, token_ids, n)
        return [(table[i], self._key(g, state.block_hashes[i]), tuple(token_ids[i * bs:(i + 1) * bs]))
                for i in range(n) for g, table in enumerate(state.tables)
                if i < len(table) and table[i] != self.null]

    def prompt_keys(self, token_ids: list[int], salt: str | None = None) -> list[BlockHash]:
        """Pool keys of every group's full blocks before the last token of a prompt (no request
        state: safe off the step thread)."""
        n = (len(token_ids) - 1) // self.block_size
        hashes = hash_full_blocks(self.namespace, token_ids[:n * self.block_size], self.block_size,
                                  algo=self.hash_algo, salt=salt) if n > 0 else []
        return [self._key(g, h) for h in hashes for g in range(len(self.groups))]

    def _lookup_all(self, g: int, state: _ReqState, token_ids: list[int], n: int) -> list[int | None]:
        bs = self.block_size
        return [self.pool.lookup(self._key(g, state.block_hashes[i]), tuple(token_ids[i * bs:(i + 1) * bs]))
                for i in range(n)]

    def _full_run(self, found: list[list[int | None]], n: int) -> int:
        run = n
        for g, blocks in enumerate(found):
            if not self.groups[g].spec.keeps_window:
                run = min(run, next((i for i, b in enumerate(blocks) if b is None), n))
        return run

    def _hits_at(self, found, h: int) -> list[list[int]] | None:
        out = []
        for g, blocks in enumerate(found):
            start = self.groups[g].spec.first_needed_block(h * self.block_size, self.block_size)
            tail = blocks[start:h]
            if any(b is None for b in tail):
                return None
            out.append([self.null] * start + tail)
        return out

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int,
                            hit_blocks: list[list[int]] | None = None) -> None:
        """Count one admitted request's lookup; hit tokens by source when its hit blocks are given."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens
        by_source = self.stats.hits_by_source
        for i in range(num_hit_tokens // self.block_size):
            sources = [self.loaded_from.pop(t[i], None) for t in hit_blocks or [] if i < len(t)]
            src = next((x for x in sources if x is not None), "device")
            by_source[src] = by_source.get(src, 0) + self.block_size

    def set_salt(self, req_id: str, salt: str | None) -> None:
        """Mix `salt` into the request's block hashes (call before its first lookup); None: no salt."""
        if salt:
            self.salts[req_id] = salt
        else:
            self.salts.pop(req_id, None)

    def set_retention(self, req_id: str, retention, num_prompt_tokens: int) -> None:
        """Pin the request's prompt blocks as they are cached; `retention` has priority (0-100),
        ttl_s (None: no expiry) and max_tokens (None: the whole prompt); None: no pin."""
        if retention is None or not self.enable_prefix_caching:
            self.retention.pop(req_id, None)
            return
        ttl = retention.ttl_s
        expires_at = math.inf if ttl is None else self.pool.clock() + ttl
        n = num_prompt_tokens if retention.max_tokens is None else min(num_prompt_tokens, retention.max_tokens)
        self.retention[req_id] = _Retention(retention.priority, expires_at, n // self.block_size)

    def drop_prefix(self, req_id: str) -> int:
        """Forget every block the request read from the prefix cache or registered in it, on the device
        and (the listeners' `removed`) in the tiers: a request failed on them. Returns how many
        device blocks lost their hash."""
        state = self.reqs.get(req_id)
        if state is None or not self.enable_prefix_caching:
            return 0
        keys = [self._key(g, h) for h in state.block_hashes[:state.num_registered] for g in range(len(self.groups))]
        dropped = self.pool.forget(keys)
        for listener in self.listeners:
            listener.removed(keys)
        if self.events is not None and dropped:
            self._report_removed(dropped)
        return len(dropped)

    def drop_salt(self, req_id: str) -> None:
        """Forget a finished request's salt."""
        self.salts.pop(req_id, None)

    def reset_prefix_cache(self, offload: bool = False) -> int:
        """Forget hashes of all free blocks (owned blocks keep theirs); `offload` hands them to the
        listeners as evicted (the tiers write them down)."""
        before = set(self.pool.cached) if self.events is not None else ()
        dropped: Evicted | None = [] if offload else None
        n = self.pool.reset_cache(dropped)
        if dropped:
            self._evicted(dropped, report=False)  # the reset is reported below, once
        if self.events is not None:
            self._report_reset(before)
        return n

    # ---- allocation ----------------------------------------------------------------
    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: list[list[int]] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        state = self._state(req_id)
        computed = new_computed_blocks or [[] for _ in self.groups]
        self._free_skipped(state, num_computed_tokens)
        done = [num_computed_tokens - off for off in self._offsets(req_id) or [0] * len(self.groups)]
        needs, cows, revived = [], [], 0
        for g, table in enumerate(state.tables):
            needs.append(max(0, self.blocks_for_tokens(done[g] + num_new_tokens) - len(table) - len(computed[g])))
            cows.append(self._needs_copy(table, done[g], num_new_tokens))
            revived += sum(1 for b in set(computed[g]) if b != self.null and self.pool.blocks[b].ref_cnt == 0)
        if sum(needs) + sum(cows) + revived > self.pool.num_free:
            return False
        rows = self._rows_needed(done, num_new_tokens)
        if not self._rows_fit(state, rows):
            return False
        self.rows_held += rows - state.rows
        state.rows = rows
        self._observe_reuse(computed)
        for g, table in enumerate(state.tables):  # take every group's hits before allocating any block
            if computed[g]:
                self.pool.touch([b for b in computed[g] if b != self.null])
                table.extend(computed[g])
        for g, table in enumerate(state.tables):
            if cows[g]:
                self._copy_on_write(table, done[g] // self.block_size)
            table.extend(self.allocate_blocks(needs[g]))
        if any(computed):
            state.num_registered = max(len(c) for c in computed)
        return True

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's newly full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching or self._offsets(req_id) is not None:
            return
        state = self.reqs[req_id]
        num_full = num_computed_tokens // self.block_size
        if num_full > state.num_registered:
            self._register(req_id, state, token_ids, num_full)
        if req_id in self.retention:
            self._pin(req_id, state, num_full)

    def _register(self, req_id: str, state: _ReqState, token_ids: list[int], num_full: int) -> None:
        self._extend_hashes(req_id, state, token_ids, num_full)
        bs = self.block_size
        stored: list[list[int]] = [[] for _ in state.tables]  # per group: blocks newly cached
        for i in range(state.num_registered, num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            for g, table in enumerate(state.tables):
                if i < len(table) and table[i] != self.null and self._store(table[i], g, state, i, tokens):
                    stored[g].append(i)
        state.num_registered = num_full
        if self.events is not None:
            for g, idx in enumerate(stored):
                self._report_stored(g, idx, state.block_hashes, token_ids)

    def _pin(self, req_id: str, state: _ReqState, num_full: int) -> None:
        """Pin (or raise the pin of) the request's cached prompt blocks not offered yet."""
        ret = self.retention[req_id]
        end = min(num_full, ret.num_blocks)
        refused = 0
        for i in range(state.num_pinned, end):
            for table in state.tables:
                b = table[i] if i < len(table) else self.null
                if b != self.null and self.pool.blocks[b].block_hash is not None:
                    refused += not self._pin_block(b, ret)
        state.num_pinned = max(state.num_pinned, end)
        if refused:
            log.debug("request %s: %d prefix blocks not pinned, the pin share (%d blocks) is full",
                      req_id, refused, self.pool.pin_limit)

    def _pin_block(self, block_id: int, ret: _Retention) -> bool:
        """Pin one block; the listeners hear of it when the pin is new."""
        taken = self.pool.pin_counts["taken"]
        if not self.pool.pin(block_id, ret.priority, ret.expires_at):
            return False
        if self.pool.pin_counts["taken"] > taken:
            block = self.pool.blocks[block_id]
            for listener in self.listeners:
                listener.pinned(block_id, block.block_hash, block.token_ids)
        return True

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first so tails are evicted first."""
        state = self.reqs.pop(req_id, None)
        self.retention.pop(req_id, None)
        if state is not None:
            self.rows_held -= state.rows
            for table in state.tables:
                self.pool.free([b for b in reversed(table) if b != self.null])

    def fork(self, src_id: str, dst_id: str) -> None:
        """Give `dst_id` the same blocks as `src_id` (shared; copied on write)."""
        src = self.reqs[src_id]
        if dst_id in self.reqs:
            raise ValueError(f"request {dst_id!r} already holds blocks")
        for table in src.tables:
            self.pool.touch([b for b in table if b != self.null])
        # the child counts the rows of the still-filling blocks it shares: it keeps them if the parent ends first
        self.reqs[dst_id] = _ReqState([list(t) for t in src.tables], list(src.block_hashes), src.num_registered,
                                      src.rows)
        self.rows_held += src.rows
        self.set_salt(dst_id, self.salts.get(src_id))

    # ---- swap ----------------------------------------------------------------------
    def swap_out_tables(self, req_id: str, num_tokens: int) -> list[list[int]]:
        """The blocks holding the request's first `num_tokens` tokens, per group (null entries kept)."""
        n = self.blocks_for_tokens(num_tokens)
        return [list(t[:n]) for t in self.reqs[req_id].tables]

    def allocate_restored(self, req_id: str, layout: list[list[bool]]) -> list[list[int]] | None:
        """Fresh blocks where `layout` is True (null elsewhere) as the request's new tables; None if short."""
        need = sum(sum(g) for g in layout)
        if req_id in self.reqs:
            raise ValueError(f"request {req_id!r} already holds blocks")
        if need > self.pool.num_free:
            return None
        fresh = iter(self.allocate_blocks(need))
        tables = [[next(fresh) if used else self.null for used in g] for g in layout]
        self.reqs[req_id] = _ReqState(tables)
        return tables

    def unshare(self, req_id: str, at: list[tuple[int, int]],
                copy: Callable[[list[tuple[int, int]]], None]) -> list[tuple[int, int]] | None:
        """Give the request a private block at each (group, index) of `at`: fresh blocks are taken,
        `copy` (the storage's copy_blocks) is run on the (old, new) pairs, the new blocks replace
        the old in the tables and the old are released. Returns the pairs; None (and no change)
        when the pool has too few free blocks."""
        if len(at) > self.pool.num_free:
            return None
        fresh = self.allocate_blocks(len(at))
        tables = self.reqs[req_id].tables
        pairs = [(tables[g][i], b) for (g, i), b in zip(at, fresh)]
        copy(pairs)
        self.pool.free([old for old, _ in pairs])
        self.replace_blocks(req_id, [(g, i, b) for (g, i), b in zip(at, fresh)])
        return pairs

    def replace_blocks(self, req_id: str, changes: list[tuple[int, int, int]]) -> None:
        """Put block b at index i of the request's table in group g, for each (g, i, b): the caller
        copied the old block's contents into b and frees the old block itself."""
        tables = self.reqs[req_id].tables
        for g, i, b in changes:
            tables[g][i] = b

    def release_tail(self, req_id: str, group: int, num_blocks: int) -> int:
        """Keep the first `num_blocks` blocks of the request's table in `group`, free the rest
        (eviction compacted the survivors into them); returns how many blocks were freed."""
        table = self.reqs[req_id].tables[group]
        tail = [b for b in reversed(table[num_blocks:]) if b != self.null]
        del table[num_blocks:]
        self.pool.free(tail)
        return len(tail)

    def trim(self, req_id: str, num_tokens: int) -> int:
        """Keep the blocks holding the request's first `num_tokens` tokens in every group and free
        the rest (speculative decoding: the lookahead slots of rejected tokens); returns how many
        were freed. Their hashes were never registered: cache_blocks runs on accepted tokens only."""
        keep = self.blocks_for_tokens(num_tokens)
        return sum(self.release_tail(req_id, g, keep) for g in range(len(self.groups)))

    def _offsets(self, req_id: str) -> list[int] | None:
        return self.eviction.offsets(req_id)

    def allocate_blocks(self, n: int) -> list[int]:
        """Take `n` free blocks (the listeners hear of the cached ones among them first)."""
        evicted: Evicted = []
        blocks = [b.block_id for b in self.pool.allocate(n, evicted)]
        if evicted:
            self._evicted(evicted)
        return blocks

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) the storage must run before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- what the listeners hear ---------------------------------------------------------
    def _store(self, block_id: int, g: int, state: _ReqState, i: int, tokens: tuple[int, ...]) -> bool:
        """Register block i of group g under its hash; True (and the listeners told) if it was."""
        key = self._key(g, state.block_hashes[i])
        if not self.pool.register(block_id, key, tokens):
            return False
        for listener in self.listeners:
            listener.stored(block_id, key, tokens)
        return True

    def _evicted(self, evicted: Evicted, report: bool = True) -> None:
        """Cached blocks leave the device cache: the listeners write them down, events report them."""
        for block_id, _, _ in evicted:
            self.loaded_from.pop(block_id, None)
        for listener in self.listeners:
            listener.evicted(evicted)
        if report and self.events is not None:
            self._report_removed([key for _, key, _ in evicted])

    # ---- KV events (kv/events.py) ----------------------------------------------------
    def _report_stored(self, g: int, idx: list[int], hashes: list[BlockHash], token_ids: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks `idx` of group `g`."""
        from kvserve.kv.events import BlockStored
        bs = self.block_size
        runs: list[list[int]] = []
        for i in idx:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self.events.add(BlockStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else None,
                                        list(token_ids[run[0] * bs:(run[-1] + 1) * bs]), bs, group=g))

    def _report_removed(self, keys: list[BlockHash]) -> None:
        """BlockRemoved for pool keys that left the cache, one event per KV group."""
        from kvserve.kv.events import BlockRemoved
        by_group: dict[int, list[BlockHash]] = {}
        for key in keys:
            block_hash, g = self.split_key(key)
            by_group.setdefault(g, []).append(block_hash)
        for g, hashes in sorted(by_group.items()):
            self.events.add(BlockRemoved(hashes, group=g))

    def split_key(self, key: BlockHash) -> tuple[BlockHash, int]:
        """(chained hash, KV group) of a pool key: the hash, + 2 bytes of group past group 0."""
        return split_key(key, self.hash_algo)

    def _report_reset(self, before: set[BlockHash]) -> None:
        """AllBlocksCleared when no block stays cached; else BlockRemoved for the keys that went."""
        from kvserve.kv.events import AllBlocksCleared
        if not self.pool.cached:
            self.events.add(AllBlocksCleared())
        else:
            self._report_removed([k for k in before if k not in self.pool.cached])

    def _load_from_lower(self, state: _ReqState, token_ids: list[int], found, n: int) -> bool:
        """Load device misses of the longest prefix the tiers can complete; True if any loaded."""
        if self.pool.num_free < self.max_blocks_for_tokens(len(token_ids)):
            return False  # the request could not run now anyway: do not churn the pool
        missing = [(g, i) for g in range(len(self.groups)) for i in range(n) if found[g][i] is None]
        if not missing:
            return False
        keys = {gi: self._key(gi[0], state.block_hashes[gi[1]]) for gi in missing}
        where = dict(zip(missing, self.lower.locate([keys[gi] for gi in missing])))
        h = self._tier_run(found, where, n)
        need = [(g, i) for g, i in missing if i < h and where[(g, i)] is not None
                and i >= self.groups[g].spec.first_needed_block(h * self.block_size, self.block_size)]
        if not need:
            return False
        keep = [b for g, blocks in enumerate(found)
                for b in blocks[self.groups[g].spec.first_needed_block(h * self.block_size, self.block_size):h]
                if b is not None and b != self.null and self.pool.blocks[b].ref_cnt == 0]
        self.pool.touch(keep)  # the device hits must survive the allocation below
        fresh: list[int] = []
        try:
            if len(need) > self.pool.num_free:
                return False
            fresh = self.allocate_blocks(len(need))
            bs = self.block_size
            items = [(keys[gi], tuple(token_ids[gi[1] * bs:(gi[1] + 1) * bs]), b) for gi, b in zip(need, fresh)]
            loaded = self.lower.load(items, self.take_pending_copies)
            for (g, i), (key, tokens, block_id), src in zip(need, items, loaded):
                if src is not None and self._store(block_id, g, state, i, tokens):
                    self.loaded_from[block_id] = src
                    if self.events is not None:
                        self._report_stored(g, [i], state.block_hashes, token_ids)
        finally:  # loaded blocks stay cached and free (revived by allocate_slots); failed ones go first
            self.pool.free(list(reversed(fresh)))
            self.pool.free(list(reversed(keep)), stamp=False)
        return True

    def _tier_run(self, found, where, n: int) -> int:
        """Longest hit length (blocks) with every needed block on the device or in a tier."""
        def have(g: int, i: int) -> bool:
            return found[g][i] is not None or where.get((g, i)) is not None
        h = n
        for g, grp in enumerate(self.groups):
            if not grp.spec.keeps_window:
                h = min(h, next((i for i in range(n) if not have(g, i)), n))
        while h > 0 and not all(
                have(g, i) for g, grp in enumerate(self.groups)
                for i in range(grp.spec.first_needed_block(h * self.block_size, self.block_size), h)):
            h -= 1
        return h

    # ---- helpers -------------------------------------------------------------------
    def _state(self, req_id: str) -> _ReqState:
        if req_id not in self.reqs:
            self.reqs[req_id] = _ReqState([[] for _ in self.groups])
        return self.reqs[req_id]

    def _key(self, group: int, block_hash: BlockHash) -> BlockHash:
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def _observe_reuse(self, computed: list[list[int]]) -> None:
        """Reuse gap of each free cached block a hit takes back (blocks just loaded from a tier excluded)."""
        revived = {b for blocks in computed for b in blocks
                   if b != self.null and self.pool.blocks[b].ref_cnt == 0 and b not in self.loaded_from}
        if revived:
            now = self.pool.clock()
            for b in revived:
                self.pool.reuse_gap.observe(now - self.pool.blocks[b].freed_at)

    def _extend_hashes(self, req_id: str, state: _ReqState, token_ids: list[int], num_blocks: int) -> None:
        have = len(state.block_hashes)
        if num_blocks > have:
            parent = state.block_hashes[-1] if have else None
            state.block_hashes.extend(
                hash_full_blocks(self.namespace, token_ids[:num_blocks * self.block_size],
                                 self.block_size, start_block=have, parent=parent, algo=self.hash_algo,
                                 salt=self.salts.get(req_id)))

    def _free_skipped(self, state: _ReqState, num_computed: int) -> None:
        """Sliding groups drop blocks wholly outside the window of every future query."""
        for g, table in enumerate(state.tables):
            end = min(self.groups[g].spec.first_needed_block(num_computed, self.block_size), len(table))
            dropped = [b for b in table[:end] if b != self.null]
            if dropped:
                self.pool.free(dropped)
                table[:end] = [self.null] * end

    def _rows_needed(self, done: list[int], num_new: int) -> int:
        """Residual rows a request holds while a step writes `num_new` tokens after `done` per group:
        the block it completes from the middle (its row is given back after the step) and the
        block it leaves still filling (one row when they are the same block)."""
        if self.residual_rows is None:
            return 0
        bs, total = self.block_size, 0
        for d in done:
            end = d + num_new
            starts_inside = d % bs != 0
            same_block = starts_inside and end // bs == d // bs
            total += starts_inside + (end % bs != 0 and not same_block)
        return total

    def _rows_fit(self, state: _ReqState, rows: int) -> bool:
        return self.residual_rows is None or self.rows_held - state.rows + rows <= self.residual_rows

    def _needs_copy(self, table: list[int], num_computed: int, num_new: int) -> bool:
        index = num_computed // self.block_size
        partial = num_computed % self.block_size != 0
        return (num_new > 0 and partial and index < len(table) and table[index] != self.null
                and self.pool.blocks[table[index]].ref_cnt > 1)

    def _copy_on_write(self, table: list[int], index: int) -> None:
        old = table[index]
        new = self.allocate_blocks(1)[0]
        self.pending_copies.append((old, new))
        self.num_cow_copies += 1
        self.pool.free([old])
        table[index] = new
