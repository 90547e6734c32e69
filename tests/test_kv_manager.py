"""Unit tests of the KV block pool, manager and storage, with hand-computed expectations.

Block ids are written relative to the pool's initial free queue (`B[i]` is the i-th block handed
out), so the expectations hold whether or not a null block is reserved.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvserve.kv.block_pool import BlockPool, BlockPoolListener
from kvserve.kv.hashing import hash_block, hash_full_blocks, namespace_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import FullSpec, KVGroup, MLASpec, SlidingWindowSpec
from kvserve.kv.storage import KVStorage

NS = namespace_hash("unit-model", "float16", "kv-manager")


def make(num_blocks: int = 16, block_size: int = 4, **kw) -> tuple[KVCacheManager, list[int]]:
    """A manager and its blocks in the order a fresh pool hands them out."""
    m = KVCacheManager(num_blocks, block_size, NS, **kw)
    return m, list(m.pool.free_queue)


def lookup(m: KVCacheManager, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    """get_computed_blocks for the single (full-attention) group."""
    hits, num_hit = m.get_computed_blocks(rid, tokens)
    assert len(hits) == 1
    return hits[0], num_hit


def admit(m: KVCacheManager, rid: str, tokens: list[int]) -> list[list[int]]:
    """Admit a request as the scheduler does (prefix hits + the rest); returns its hits."""
    hits, num_hit = m.get_computed_blocks(rid, tokens)
    assert m.allocate_slots(rid, num_hit, len(tokens) - num_hit, hits)
    m.cache_blocks(rid, tokens, len(tokens))
    return hits


def append(m: KVCacheManager, rid: str, tokens: list[int], extra: list[int]) -> list[int]:
    """Grow a request by `extra` tokens (allocate, then register newly full blocks)."""
    assert m.allocate_slots(rid, len(tokens), len(extra))
    tokens = tokens + extra
    m.cache_blocks(rid, tokens, len(tokens))
    return tokens


def probe(m: KVCacheManager, tokens: list[int]) -> list[int]:
    """Group-0 prefix hits a new request with these tokens would get (leaves no state behind)."""
    hits, _ = m.get_computed_blocks("__probe__", tokens)
    m.free("__probe__")
    return hits[0]


def refs(m: KVCacheManager, blocks: list[int]) -> list[int]:
    return [m.pool.blocks[b].ref_cnt for b in blocks]


def snapshot(m: KVCacheManager):
    pool = m.pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
        list(pool.free_queue), dict(pool.cached), pool.num_evicted,
        {rid: ([list(t) for t in s.tables], list(s.block_hashes), s.num_registered)
         for rid, s in m.reqs.items()},
        list(m.pending_copies),
    )


# ---- prefix hits -------------------------------------------------------------------------
def test_prefix_hit_leaves_last_prompt_token_for_recompute():
    m, B = make(16, 4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert admit(m, "a", prompt) == [[]]
    assert m.block_ids("a") == B[:2]
    assert lookup(m, "b", prompt) == ([B[0]], 4)  # 8 tokens: hit 4, not 8
    assert lookup(m, "c", prompt + [9]) == (B[:2], 8)
    assert lookup(m, "d", prompt[:5]) == ([B[0]], 4)
    assert lookup(m, "e", prompt[:4]) == ([], 0)  # one full block, all of the prompt
    assert lookup(m, "f", [1]) == ([], 0)
    m.free("a")  # freed blocks stay findable
    assert lookup(m, "g", prompt) == ([B[0]], 4)


def test_prefix_hit_stops_at_first_miss_and_never_hits_partial_blocks():
    m, B = make(16, 4)
    admit(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # blocks: [1-4] [5-8] [9,10]
    assert probe(m, [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11]) == [B[0]]
    assert probe(m, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == []
    assert probe(m, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]) == B[:2]  # [9,10] was partial


def test_admit_with_hits_shares_blocks_and_counts_refs():
    m, B = make(16, 4)
    admit(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(m, "b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]) == [B[:2]]
    assert m.block_ids("a") == B[:3]
    assert m.block_ids("b") == [B[0], B[1], B[3]]
    assert refs(m, B[:4]) == [2, 2, 1, 1]
    assert m.pool.num_free == len(B) - 4


def test_prefix_caching_disabled_never_hits_or_hashes():
    m, _ = make(16, 4, enable_prefix_caching=False)
    admit(m, "a", list(range(1, 10)))
    assert lookup(m, "b", list(range(1, 10))) == ([], 0)
    assert m.pool.cached == {}
    assert all(b.block_hash is None for b in m.pool.blocks)


def test_cache_blocks_registers_only_full_computed_blocks():
    m, B = make(16, 2)
    hits, n = m.get_computed_blocks("a", [1, 2, 3, 4, 5])
    assert m.allocate_slots("a", n, 5, hits)
    m.cache_blocks("a", [1, 2, 3, 4, 5], 3)  # only 3 tokens computed so far: one full block
    assert [m.pool.blocks[b].token_ids for b in B[:3]] == [(1, 2), None, None]
    m.cache_blocks("a", [1, 2, 3, 4, 5], 5)
    assert [m.pool.blocks[b].token_ids for b in B[:3]] == [(1, 2), (3, 4), None]
    assert m.pool.num_cached == 2


def test_duplicate_full_block_first_writer_wins():
    m, B = make(16, 2)
    for rid in ("a", "b"):  # both computed before either cached: two copies of the same block
        hits, n = m.get_computed_blocks(rid, [1, 2, 3])
        assert m.allocate_slots(rid, n, 3, hits)
    m.cache_blocks("a", [1, 2, 3], 3)
    m.cache_blocks("b", [1, 2, 3], 3)
    a0, b0 = m.block_ids("a")[0], m.block_ids("b")[0]
    assert m.pool.blocks[a0].block_hash is not None and m.pool.blocks[b0].block_hash is None
    assert probe(m, [1, 2, 3]) == [a0]


# ---- LRU order ---------------------------------------------------------------------------
def test_lru_reuses_least_recently_freed_first_and_tails_before_heads():
    m, B = make(8, 2)
    admit(m, "a", [1, 2, 3, 4])
    admit(m, "b", [5, 6, 7, 8])
    assert m.block_ids("a") == B[0:2] and m.block_ids("b") == B[2:4]
    m.free("a")
    m.free("b")
    # never-used blocks first, then A (tail before head), then B (tail before head)
    assert list(m.pool.free_queue) == B[4:8] + [B[1], B[0], B[3], B[2]]
    assert m.pool.num_free == 8 and m.pool.num_cached_free == 4
    admit(m, "c", [11, 12, 13, 14])
    admit(m, "d", [15, 16, 17, 18])
    assert m.block_ids("c") == B[4:6] and m.block_ids("d") == B[6:8]  # no cached block evicted yet
    assert m.pool.num_evicted == 0
    admit(m, "e", [21, 22])
    assert m.block_ids("e") == [B[1]]  # A's tail goes first...
    assert probe(m, [1, 2, 3, 4, 99]) == [B[0]]  # ...so A's head still hits
    assert m.pool.num_evicted == 1
    admit(m, "f", [23, 24])
    assert m.block_ids("f") == [B[0]]
    assert probe(m, [1, 2, 3, 4, 99]) == []
    assert probe(m, [5, 6, 7, 8, 99]) == B[2:4]  # B, freed later, survives A
    admit(m, "g", [25, 26])
    assert m.block_ids("g") == [B[3]]


def test_lru_hit_then_free_makes_blocks_most_recently_used():
    m, B = make(8, 2)
    admit(m, "a", [1, 2, 3, 4])
    admit(m, "b", [5, 6, 7, 8])
    m.free("a")
    m.free("b")
    assert admit(m, "c", [1, 2, 3, 4, 9]) == [B[:2]]  # A's blocks revived, one new block
    assert m.block_ids("c") == [B[0], B[1], B[4]]
    m.free("c")
    # C's partial tail (no hash) to the front; A's blocks now behind B's
    assert list(m.pool.free_queue) == B[4:8] + [B[3], B[2], B[1], B[0]]


def test_blocks_without_hash_are_reused_before_cached_ones():
    m, B = make(8, 2)
    admit(m, "a", [1, 2, 3])  # first block full (cached), second partial (no hash)
    assert m.block_ids("a") == B[:2]
    m.free("a")
    assert list(m.pool.free_queue) == B[1:] + [B[0]]
    admit(m, "b", [9] * 13)  # 7 blocks: every block but the cached one
    assert m.block_ids("b") == B[1:]
    assert probe(m, [1, 2, 3]) == [B[0]]


def test_hit_revives_free_cached_block():
    m, B = make(8, 2)
    admit(m, "a", [1, 2, 3, 4, 5])
    assert m.block_ids("a") == B[:3]
    m.free("a")
    assert list(m.pool.free_queue) == B[2:] + [B[1], B[0]]
    assert lookup(m, "b", [1, 2, 3, 4, 5, 6]) == (B[:2], 4)
    assert m.allocate_slots("b", 4, 2, [B[:2]])
    assert m.block_ids("b") == B[:3]
    assert refs(m, B[:3]) == [1, 1, 1]
    assert list(m.pool.free_queue) == B[3:]
    assert m.pool.num_free == 5 and m.pool.num_cached_free == 0
    assert m.pool.blocks[B[0]].block_hash is not None  # revived, not evicted
    assert m.pool.num_evicted == 0


def test_reset_prefix_cache_forgets_free_blocks_only():
    m, _ = make(8, 2)
    admit(m, "a", [1, 2, 3, 4, 5])
    admit(m, "b", [7, 8, 9])
    m.free("a")
    assert m.reset_prefix_cache() == 2
    assert probe(m, [1, 2, 3, 4, 5]) == []
    assert probe(m, [7, 8, 9]) == m.block_ids("b")[:1]  # owned blocks keep their hash
    assert m.reset_prefix_cache() == 0


# ---- hash chain --------------------------------------------------------------------------
def test_block_hash_is_sha256_of_parent_and_tokens():
    want0 = hashlib.sha256(NS + struct.pack("<2q", 1, 2)).digest()
    want1 = hashlib.sha256(want0 + struct.pack("<2q", 3, 4)).digest()
    assert hash_block(NS, [1, 2]) == want0
    assert hash_full_blocks(NS, [1, 2, 3, 4, 5], 2) == [want0, want1]  # partial dropped
    assert namespace_hash("m", "fp16", 16) == hashlib.sha256(b"m|fp16|16|hash=sha256").digest()


def test_same_tokens_after_different_prefix_hash_differently():
    a = hash_full_blocks(NS, [1, 2, 3, 4], 2)
    b = hash_full_blocks(NS, [9, 9, 3, 4], 2)
    assert a[1] != b[1]
    assert hash_full_blocks(NS, [1, 2, 3, 4], 2) == a  # deterministic
    assert hash_block(NS, [1, 2]) != hash_block(NS, [2, 1])
    assert hash_full_blocks(NS, [1, 2, 3, 4], 2) != hash_full_blocks(NS, [1, 2, 3, 4], 4)


def test_namespace_changes_every_hash():
    tokens = list(range(12))
    other = namespace_hash("unit-model", "fp8", "kv-manager")
    assert other != NS
    assert not set(hash_full_blocks(NS, tokens, 4)) & set(hash_full_blocks(other, tokens, 4))
    parts = ("m", "fp16", 16, "full")
    variants = [namespace_hash(*parts)] + [
        namespace_hash(*parts[:i], "x", *parts[i + 1:]) for i in range(len(parts))]
    assert len(set(variants)) == len(variants)


def test_hash_chain_continues_from_parent():
    tokens = list(range(10))
    full = hash_full_blocks(NS, tokens, 2)
    assert hash_full_blocks(NS, tokens, 2, start_block=2, parent=full[1]) == full[2:]


def test_manager_hits_need_the_whole_prefix_and_the_namespace():
    m, B = make(16, 2)
    admit(m, "a", [9, 9, 3, 4, 5])
    assert probe(m, [1, 1, 3, 4, 5]) == []  # block [3,4] equal, but after a different prefix
    assert probe(m, [9, 9, 3, 4, 5]) == B[:2]
    other = KVCacheManager(16, 2, namespace_hash("another-model"))
    admit(other, "a", [9, 9, 3, 4, 5])
    assert not set(m.pool.cached) & set(other.pool.cached)


def test_pool_lookup_checks_tokens_not_just_hash():
    pool = BlockPool(4)
    h = hash_block(NS, [1, 2])
    (blk,) = pool.allocate(1)
    pool.register(blk.block_id, h, (1, 2))
    assert pool.lookup(h, (1, 2)) == blk.block_id
    assert pool.lookup(h, (1, 3)) is None
    assert pool.lookup(hash_block(NS, [1, 3]), (1, 3)) is None


# ---- allocation failure leaves no trace ---------------------------------------------------
def test_allocate_slots_short_pool_for_new_request_changes_nothing():
    m, _ = make(4, 2)
    admit(m, "a", [1, 2, 3, 4, 5, 6])  # 3 of 4 blocks
    hits, n = m.get_computed_blocks("b", [7, 8, 9, 10])
    before = snapshot(m)
    assert not m.allocate_slots("b", n, 4, hits)
    assert snapshot(m) == before


def test_allocate_slots_counts_revived_hits_against_the_free_pool():
    m, B = make(4, 2)
    admit(m, "a", [1, 2, 3, 4])
    m.free("a")
    admit(m, "c", [7, 8, 9, 10])
    assert m.block_ids("c") == B[2:4] and list(m.pool.free_queue) == [B[1], B[0]]
    hits, n = m.get_computed_blocks("b", [1, 2, 3, 4, 5])
    assert (hits, n) == ([B[:2]], 4)
    before = snapshot(m)
    assert not m.allocate_slots("b", n, 1, hits)  # 2 revived + 1 new > 2 free
    assert snapshot(m) == before
    assert probe(m, [1, 2, 3, 4, 5]) == B[:2]  # A's cached blocks untouched
    m.free("b")
    hits, n = m.get_computed_blocks("d", [1, 2, 3, 4])  # 1 revived + 1 new == 2 free: fits
    assert (hits, n) == ([[B[0]]], 2)
    assert m.allocate_slots("d", n, 2, hits)
    assert m.block_ids("d") == B[:2] and m.pool.num_free == 0


def test_allocate_slots_short_pool_for_append_and_copy_on_write_changes_nothing():
    m, B = make(4, 2)
    admit(m, "a", [1, 2, 3])  # [full, partial]
    m.fork("a", "b")
    admit(m, "c", [5, 6, 7, 8])  # pool now full
    assert m.pool.num_free == 0
    for rid in ("b", "a"):  # the copy on write needs a block
        before = snapshot(m)
        assert not m.allocate_slots(rid, 3, 1)
        assert snapshot(m) == before
    before = snapshot(m)
    assert not m.allocate_slots("c", 4, 1)  # growth needs a block
    assert snapshot(m) == before
    m.free("c")
    assert m.allocate_slots("b", 3, 1)
    assert m.take_pending_copies() == [(B[1], m.block_ids("b")[1])]


# ---- fork and copy on write ----------------------------------------------------------------
def test_fork_append_copies_partial_last_block_once():
    m, B = make(16, 4)
    admit(m, "a", [1, 2, 3, 4, 5, 6])
    assert m.block_ids("a") == B[:2]
    m.fork("a", "b")
    assert m.block_ids("b") == B[:2]
    assert refs(m, B[:2]) == [2, 2]
    assert m.take_pending_copies() == []
    assert m.allocate_slots("b", 6, 1)
    assert m.take_pending_copies() == [(B[1], B[2])]  # (shared old block, fresh new block)
    assert m.block_ids("b") == [B[0], B[2]] and m.block_ids("a") == B[:2]
    assert refs(m, B[:3]) == [2, 1, 1]
    assert m.allocate_slots("a", 6, 1)  # the other sibling now owns the old block alone: in place
    assert m.take_pending_copies() == []
    assert m.block_ids("a") == B[:2]
    assert m.allocate_slots("b", 7, 1)  # and the copy is B's own
    assert m.take_pending_copies() == []
    assert m.block_ids("b") == [B[0], B[2]]


def test_fork_with_full_last_block_needs_no_copy():
    m, B = make(16, 4)
    admit(m, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    m.fork("a", "b")
    assert m.allocate_slots("a", 8, 1) and m.allocate_slots("b", 8, 1)
    assert m.take_pending_copies() == []
    assert m.block_ids("a") == B[:3] and m.block_ids("b") == [B[0], B[1], B[3]]


def test_three_way_fork_copies_for_each_writer_but_the_last():
    m, B = make(16, 4)
    admit(m, "a", [1, 2, 3, 4, 5, 6])
    m.fork("a", "b")
    m.fork("a", "c")
    assert refs(m, B[:2]) == [3, 3]
    assert m.allocate_slots("b", 6, 1) and m.allocate_slots("c", 6, 1)
    assert m.allocate_slots("a", 6, 1)
    assert m.take_pending_copies() == [(B[1], B[2]), (B[1], B[3])]
    assert m.block_ids("a") == B[:2]
    assert m.block_ids("b") == [B[0], B[2]] and m.block_ids("c") == [B[0], B[3]]
    assert refs(m, B[:4]) == [3, 1, 1, 1]


def test_copy_on_write_append_spanning_blocks():
    m, B = make(16, 4)
    admit(m, "a", [1, 2, 3, 4, 5, 6])
    m.fork("a", "b")
    assert m.allocate_slots("b", 6, 5)  # finishes the copied block and opens another
    assert m.take_pending_copies() == [(B[1], B[2])]
    assert m.block_ids("b") == [B[0], B[2], B[3]]


def test_fork_of_single_partial_block_copies_it():
    """The very first block handed out is an ordinary block: shared, it must be copied too."""
    m, B = make(4, 2)
    admit(m, "a", [1])
    assert m.block_ids("a") == [B[0]]
    m.fork("a", "b")
    assert refs(m, [B[0]]) == [2]
    assert m.allocate_slots("b", 1, 1)
    assert m.take_pending_copies() == [(B[0], B[1])]
    m.free("a")
    m.free("b")
    assert m.pool.num_free == len(B) and all(b.ref_cnt == 0 for b in m.pool.blocks)


def test_fork_then_divergent_appends_read_back_own_tokens():
    """End to end with KVStorage: copies before writes, each sibling reads its own tokens."""
    m, _ = make(8, 4)
    bs = 4
    store = KVStorage([KVGroup(FullSpec(1, 1), [0, 1])], 8, bs, torch.int64)
    toks = {"a": [1, 2, 3, 4, 5, 6]}

    def slots(rid, start):
        table = m.block_ids(rid)
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, len(toks[rid]))])

    def write(rid, start):
        rows = torch.tensor(toks[rid][start:]).view(-1, 1, 1)
        for layer in range(2):
            store.write(layer, slots(rid, start), rows, -rows)

    def read(rid):
        k, v = store.read(1, slots(rid, 0))
        assert torch.equal(k, -v)
        return k.flatten().tolist()

    admit(m, "a", toks["a"])
    write("a", 0)
    m.fork("a", "b")
    toks["b"] = list(toks["a"])
    # one step: both siblings grow, copies run, then the forward writes
    assert m.allocate_slots("a", 6, 3) and m.allocate_slots("b", 6, 1)
    store.copy_blocks(m.take_pending_copies())
    toks["a"] += [7, 7, 7]
    toks["b"] += [8]
    write("a", 6)
    write("b", 6)
    assert read("a") == [1, 2, 3, 4, 5, 6, 7, 7, 7]
    assert read("b") == [1, 2, 3, 4, 5, 6, 8]


def test_fork_into_existing_request_raises_and_changes_nothing():
    m, _ = make(16, 4)
    admit(m, "a", [1, 2, 3])
    admit(m, "b", [4, 5, 6])
    before = snapshot(m)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.fork("a", "b")
    assert snapshot(m) == before


def test_free_unknown_request_is_a_noop_and_double_free_is_caught_by_pool():
    m, B = make(4, 2)
    before = snapshot(m)
    m.free("nobody")
    assert snapshot(m) == before
    with pytest.raises(RuntimeError, match="ref_cnt 0"):
        m.pool.free([B[0]])


def test_every_block_free_after_all_requests_end():
    m, _ = make(12, 2)
    t = [1, 2, 3, 4, 5]
    admit(m, "a", t)
    m.fork("a", "b")
    assert append(m, "b", t, [6, 7]) == [1, 2, 3, 4, 5, 6, 7]
    m.take_pending_copies()
    admit(m, "c", [1, 2, 3, 4, 5, 6, 7, 8])
    append(m, "a", t, [9])
    for rid in ("a", "b", "c"):
        m.free(rid)
    pool = m.pool
    assert m.reqs == {}
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free == pool.num_usable and m.usage() == 0.0
    uncached = sum(1 for b in pool.free_queue if pool.blocks[b].block_hash is None)
    assert uncached + pool.num_cached_free == pool.num_usable
    assert pool.num_cached_free == pool.num_cached


# ---- hybrid groups (full + sliding window) -------------------------------------------------
def hybrid(num_blocks: int, block_size: int, window: int) -> KVCacheManager:
    groups = [KVGroup(FullSpec(1, 1), [0]), KVGroup(SlidingWindowSpec(1, 1, window=window), [1])]
    return KVCacheManager(num_blocks, block_size, NS, groups=groups)


def test_hybrid_hit_blocks_of_one_group_are_not_handed_to_another():
    m = hybrid(9, 2, window=100)  # 8 usable blocks; the window never drops a block here
    admit(m, "a", [1, 2, 3, 4])
    admit(m, "c", [7, 8, 9, 10])
    m.free("a")
    m.free("c")
    hits = admit(m, "b", [1, 2, 3, 4, 5, 6, 7])  # A's 2 blocks hit in both groups, 2 new in each
    assert [len(h) for h in hits] == [2, 2]
    full, sliding = m.block_ids("b", 0), m.block_ids("b", 1)
    assert full[:2] == hits[0] and sliding[:2] == hits[1]
    assert not set(full) & set(sliding), f"groups share blocks: {full} / {sliding}"
    assert all(m.pool.blocks[b].ref_cnt == 1 for b in full + sliding)


def test_hybrid_sliding_group_drops_blocks_out_of_window():
    m = hybrid(16, 2, window=2)
    null = m.pool.reserved - 1  # the reserved null block
    assert null == 0 and 0 not in m.pool.free_queue
    admit(m, "a", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 blocks per group
    sliding0 = list(m.block_ids("a", 1))
    assert m.allocate_slots("a", 8, 1)
    # a query at 8 sees positions 7 and 8: sliding blocks 0-2 (positions 0-5) are dropped
    assert m.block_ids("a", 1)[:3] == [null] * 3 and m.block_ids("a", 1)[3] == sliding0[3]
    assert all(m.pool.blocks[b].ref_cnt == 0 and b in m.pool.free_queue for b in sliding0[:3])
    assert len(m.block_ids("a", 0)) == len(m.block_ids("a", 1)) == 5
    m.free("a")
    assert m.pool.num_free == m.pool.num_usable and m.pool.blocks[null].ref_cnt == 0


# ---- storage -------------------------------------------------------------------------------
def full_storage(num_layers, num_blocks, block_size, heads, head_dim, dtype) -> KVStorage:
    return KVStorage([KVGroup(FullSpec(heads, head_dim), list(range(num_layers)))],
                     num_blocks, block_size, dtype)


def test_storage_write_read_roundtrip_at_slots():
    torch.manual_seed(0)
    s = full_storage(2, 4, 4, 2, 8, torch.float32)
    slots = torch.tensor([0, 5, 6, 15])
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)  # [num_tokens, num_kv_heads, head_dim]
    s.write(1, slots, k, v)
    rk, rv = s.read(1, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    k1, v1 = s.slots[1]  # [num_blocks, block_size, heads, head_dim]; slot = block * bs + offset
    assert torch.equal(k1[1, 1], k[1]) and torch.equal(v1[3, 3], v[3])
    assert not any(t.any() for t in s.slots[0])  # other layer untouched
    mask = torch.ones(16, dtype=torch.bool)
    mask[slots] = False
    assert not k1.view(16, 2, 8)[mask].any() and not v1.view(16, 2, 8)[mask].any()
    rk2, _ = s.read(1, torch.tensor([[5, 6], [0, 15]]))
    assert rk2.shape == (2, 2, 2, 8)
    assert torch.equal(rk2[1, 1], k[3])


def test_storage_write_converts_to_cache_dtype():
    s = full_storage(1, 2, 4, 1, 4, torch.float16)
    k = torch.randn(3, 1, 4)
    s.write(0, torch.tensor([1, 2, 7]), k, k * 2)
    rk, rv = s.read(0, torch.tensor([1, 2, 7]))
    assert rk.dtype == torch.float16
    assert torch.equal(rk, k.half()) and torch.equal(rv, (k * 2).half())


def test_storage_copy_blocks_copies_every_layer_k_and_v():
    s = full_storage(3, 4, 2, 1, 2, torch.float32)
    tensors = [t for slot in s.slots for t in slot]
    assert len(tensors) == 6
    for i, t in enumerate(tensors):
        t.copy_(torch.arange(16, dtype=torch.float32).view(4, 2, 1, 2) + 100 * i)
    orig = [t.clone() for t in tensors]
    s.copy_blocks([(0, 2), (1, 3)])
    for t, o in zip(tensors, orig):
        assert torch.equal(t[2], o[0]) and torch.equal(t[3], o[1])
        assert torch.equal(t[:2], o[:2])  # sources unchanged
    s.copy_blocks([])  # no-op
    for t, o in zip(tensors, orig):
        assert torch.equal(t[2], o[0])


@pytest.mark.parametrize("dtype, itemsize", [(torch.float32, 4), (torch.float16, 2), (torch.int8, 1)])
def test_storage_nbytes_equals_tensor_bytes(dtype, itemsize):
    s = full_storage(2, 4, 4, 2, 8, dtype)
    # 2 layers x (K, V) x 4 blocks x 4 slots x 2 heads x 8 dims x itemsize
    assert s.nbytes == 2 * 2 * 4 * 4 * 2 * 8 * itemsize
    assert s.nbytes == sum(t.untyped_storage().nbytes() for slot in s.slots for t in slot)


def test_storage_nbytes_mla_and_hybrid_groups():
    mla = KVStorage([KVGroup(MLASpec(latent_dim=6, rope_dim=2), [0, 1, 2])], 4, 4, torch.float16)
    assert mla.nbytes == 3 * 4 * 4 * (6 + 2) * 2  # one latent (+ rope key) per token, no V
    groups = [KVGroup(FullSpec(2, 8), [0, 2]), KVGroup(SlidingWindowSpec(2, 8, window=4), [1, 3])]
    hyb = KVStorage(groups, 4, 4, torch.float32)
    assert hyb.nbytes == 2 * 2 * 4 * 4 * 2 * 8 * 4  # 4 layers in 2 groups share 2 storage slots
    assert hyb.nbytes == sum(t.untyped_storage().nbytes() for slot in hyb.slots for t in slot)


# ---- pool listeners: handed to the manager at construction ------------------------------------
class Recorder(BlockPoolListener):
    """Writes down every call in order."""

    def __init__(self):
        self.calls = []

    def stored(self, block_id, block_hash, token_ids):
        self.calls.append(("stored", block_id, block_hash, token_ids))

    def evicted(self, blocks):
        self.calls.append(("evicted", list(blocks)))

    def pinned(self, block_id, block_hash, token_ids):
        self.calls.append(("pinned", block_id, block_hash, token_ids))


class PinsOnly(BlockPoolListener):
    """Overrides one method; the others are the interface's no-ops."""

    def __init__(self):
        self.pins = []

    def pinned(self, block_id, block_hash, token_ids):
        self.pins.append(block_id)


def test_listeners_hear_each_stored_evicted_and_pinned_block():
    """4 blocks of 2 tokens, no null block: the free queue starts 0, 1, 2, 3; pins may hold 2 blocks."""
    from kvserve.sampling_params import KVRetention
    rec, pins = Recorder(), PinsOnly()
    m = KVCacheManager(4, 2, NS, listeners=[rec, pins])
    a = [1, 2, 3, 4, 5]                                  # 2 full blocks + 1 token
    ha = hash_full_blocks(NS, a, 2)
    assert m.allocate_slots("a", 0, 5)                   # blocks 0, 1, 2 (none cached: nothing evicted)
    m.cache_blocks("a", a, 5)
    assert rec.calls == [("stored", 0, ha[0], (1, 2)), ("stored", 1, ha[1], (3, 4))]
    m.free("a")                                          # tail first: queue 2 (no hash, front), 3, 1, 0
    rec.calls.clear()

    b = [7, 8, 9, 10, 11, 12, 13]                        # 3 full blocks + 1 token: all 4 blocks
    hb = hash_full_blocks(NS, b, 2)
    m.set_retention("b", KVRetention(priority=50), len(b))
    assert m.get_computed_blocks("b", b) == ([[]], 0)
    assert m.allocate_slots("b", 0, 7)                   # takes 2, 3, 1, 0: a's cached 1 and 0 go
    assert m.block_ids("b") == [2, 3, 1, 0]
    assert rec.calls == [("evicted", [(1, ha[1], (3, 4)), (0, ha[0], (1, 2))])]
    rec.calls.clear()
    m.cache_blocks("b", b, 7)                            # 3 blocks stored; 2 of them fit the pin share
    assert rec.calls == [("stored", 2, hb[0], (7, 8)), ("stored", 3, hb[1], (9, 10)),
                         ("stored", 1, hb[2], (11, 12)),
                         ("pinned", 2, hb[0], (7, 8)), ("pinned", 3, hb[1], (9, 10))]
    assert pins.pins == [2, 3] and m.pool.pin_counts["refused"] == 1
    rec.calls.clear()
    m.cache_blocks("b", b, 7)                            # nothing new: nothing told
    assert m.reset_prefix_cache(offload=True) == 0       # b holds every block: no hash is dropped
    assert rec.calls == []

    m.free("b")                                          # tail first: 0 (no hash) front, 1 back; 3, 2 pinned
    assert m.reset_prefix_cache(offload=True) == 3       # the pins end: 3 and 2 join the queue after 1
    assert rec.calls == [("evicted", [(1, hb[2], (11, 12)), (3, hb[1], (9, 10)), (2, hb[0], (7, 8))])]
    assert m.pool.num_cached == 0 and pins.pins == [2, 3]


def test_a_reset_without_offload_tells_no_listener():
    rec = Recorder()
    m = KVCacheManager(4, 2, NS, listeners=[rec])
    b = [7, 8, 9, 10, 11, 12, 13]
    assert m.allocate_slots("b", 0, 7)                   # blocks 0, 1, 2, 3
    m.cache_blocks("b", b, 7)
    m.free("b")
    rec.calls.clear()
    assert m.reset_prefix_cache() == 3 and m.pool.num_cached == 0
    assert rec.calls == []
    assert m.allocate_slots("c", 0, 8) and rec.calls == []   # the forgotten blocks are reused silently


# ---- what KV eviction asks of the manager (kv/evictor.py) ---------------------------------------
def two_layer_groups() -> list[KVGroup]:
    return [KVGroup(FullSpec(), [0]), KVGroup(FullSpec(), [1])]


def test_shared_indices_name_forked_and_hashed_blocks():
    m, B = make(12, 4, groups=two_layer_groups())
    admit(m, "a", list(range(1, 11)))               # 10 tokens: 2 full (hashed) blocks + 1 partial per group
    assert m.block_ids("a", 0) == B[0:3] and m.block_ids("a", 1) == B[3:6]
    assert m.shared_indices("a", 0, 3) == [0, 1]     # hashed: the prefix cache names them
    m.fork("a", "b")
    assert m.shared_indices("b", 1, 3) == [0, 1, 2]  # all held twice
    assert m.shared_indices("b", 1, 2) == [0, 1]     # only below `end`
    m.free("a")
    assert m.shared_indices("b", 0, 3) == [0, 1] and not m.is_shared(B[2])
    assert m.has_request("b") and not m.has_request("a")
    assert m.blocks_held("b") == 6 and m.blocks_held("a") == 0


def test_unshare_swaps_in_fresh_blocks_after_the_copy_and_releases_the_old():
    m, B = make(12, 4, groups=two_layer_groups())
    admit(m, "a", list(range(1, 11)))
    m.fork("a", "b")
    copied = []
    pairs = m.unshare("b", [(0, 0), (1, 2)], lambda p: copied.append((list(p), m.block_ids("b", 0)[:])))
    assert pairs == [(B[0], B[6]), (B[5], B[7])]
    assert copied == [([(B[0], B[6]), (B[5], B[7])], B[0:3])]   # the copy runs before the tables change
    assert m.block_ids("b", 0) == [B[6], B[1], B[2]] and m.block_ids("b", 1) == [B[3], B[4], B[7]]
    assert m.block_ids("a", 0) == B[0:3] and m.block_ids("a", 1) == B[3:6]   # the sibling keeps its own
    assert refs(m, B[:8]) == [1, 2, 2, 2, 2, 1, 1, 1]
    assert m.pool.num_free == 4


def test_unshare_on_a_short_pool_changes_nothing():
    m, B = make(8, 4, groups=two_layer_groups())
    admit(m, "a", list(range(1, 11)))                # 6 of 8 blocks taken: 2 free
    m.fork("a", "b")
    before = snapshot(m)
    assert m.unshare("b", [(0, 0), (0, 1), (0, 2)], lambda p: pytest.fail("no copy on a short pool")) is None
    assert snapshot(m) == before


def test_release_tail_frees_the_blocks_behind_the_kept_ones():
    m, B = make(12, 4, groups=two_layer_groups())
    admit(m, "a", list(range(1, 11)))
    assert m.release_tail("a", 0, 1) == 2            # keep block 0 of group 0
    assert m.block_ids("a", 0) == [B[0]] and m.block_ids("a", 1) == B[3:6]
    assert refs(m, B[:6]) == [1, 0, 0, 1, 1, 1]
    assert m.pool.num_free == 8 and m.blocks_held("a") == 4
    queue = list(m.pool.free_queue)
    assert queue[0] == B[2] and queue[-1] == B[1]    # the unhashed block is reused first, the cached one last
    assert m.release_tail("a", 1, 3) == 0 and m.block_ids("a", 1) == B[3:6]


def test_slots_map_cache_indices_through_the_group_table():
    m, B = make(12, 4, groups=two_layer_groups())
    admit(m, "a", list(range(1, 11)))
    slots = m.slots("a", 1, torch.tensor([0, 5, 9]))
    assert slots.tolist() == [B[3] * 4 + 0, B[4] * 4 + 1, B[5] * 4 + 1]
