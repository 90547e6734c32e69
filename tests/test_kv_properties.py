"""Stateful property tests of the KV cache: KVCacheManager over a BlockPool, with KVStorage as data.

A Hypothesis state machine admits, grows, forks, frees, preempts and re-admits requests over a small
pool (one full-attention KV group, or hybrid full + sliding-window groups), runs the copy-on-write
copies and writes every new token into both a shadow model (a dict block -> slots) and a real
KVStorage, and after every rule checks the pool's bookkeeping and that every request reads back
exactly its own tokens (for a sliding group: every token a future query can still see).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kv.hashing import hash_full_blocks, namespace_hash
from kvserve.kv.manager import NULL_BLOCK, KVCacheManager
from kvserve.kv.spec import FullSpec, KVGroup, SlidingWindowSpec
from kvserve.kv.storage import KVStorage

NS = namespace_hash("props-model", "int64", "kv-properties")
EMPTY = -1  # a slot no token was written to
V_OFFSET = 1000  # V rows hold token + V_OFFSET so K and V are checked apart

TOKEN = st.sampled_from([1, 2, 3])  # a tiny vocabulary so prefixes repeat
# A few shared heads make full-block prefix hits common for every block size 2-4.
HEADS = [(), (1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 3, 3, 3, 3), (2, 2, 2, 2, 2, 2)]
PROMPT = st.builds(lambda head, tail: list(head) + tail,
                   st.sampled_from(HEADS), st.lists(TOKEN, max_size=6)).filter(bool)
EXTRA = st.lists(TOKEN, min_size=1, max_size=6)
# KV group layouts: mostly the plain single full-attention group.
LAYOUTS = [("full",), ("full",), ("full",), ("full", "sliding"), ("full", "sliding"), ("sliding",),
           ("full", "full", "sliding")]


def snapshot(m: KVCacheManager):
    """Everything allocate_slots may touch, as plain comparable values."""
    pool = m.pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
        list(pool.free_queue),
        dict(pool.cached),
        pool.num_evicted,
        {rid: ([list(t) for t in s.tables], list(s.block_hashes), s.num_registered)
         for rid, s in m.reqs.items()},
        list(m.pending_copies),
    )


class KVManagerMachine(RuleBasedStateMachine):
    """Model: self.tokens[rid] = the tokens whose K/V the request has computed (and written)."""

    @initialize(num_blocks=st.one_of(st.integers(6, 12), st.integers(8, 32)),  # often under pressure
                block_size=st.integers(2, 4),
                prefix_caching=st.sampled_from([True, True, True, False]),
                layout=st.sampled_from(LAYOUTS), window=st.integers(1, 10))
    def setup(self, num_blocks, block_size, prefix_caching, layout, window):
        self.bs = block_size
        specs = [SlidingWindowSpec(1, 1, window=window) if kind == "sliding" else FullSpec(1, 1) for kind in layout]
        groups = [KVGroup(spec, [g]) for g, spec in enumerate(specs)]
        self.specs, self.G = specs, len(groups)
        self.single = layout == ("full",)  # exact LRU-order checks only for the plain layout
        self.m = KVCacheManager(num_blocks, block_size, NS, enable_prefix_caching=prefix_caching,
                                groups=groups)
        # Block ids never overlap across groups, so one shadow and one storage slot serve them all.
        self.storage = KVStorage(groups, num_blocks, block_size, torch.int64)
        for slot in self.storage.slots:
            for t in slot:
                t.fill_(EMPTY)
        self.shadow = {b: [EMPTY] * block_size for b in range(num_blocks)}
        self.tokens: dict[str, list[int]] = {}
        self.seen: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # key -> (group, token prefix)
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _placeholder(self, b: int) -> bool:
        """True for the null block standing in for a dropped sliding-window block."""
        return b == NULL_BLOCK and NULL_BLOCK < self.m.pool.reserved

    def _chain(self, tokens) -> list[bytes]:
        return hash_full_blocks(NS, list(tokens), self.bs)

    def _key(self, g: int, h: bytes) -> bytes:
        return self.m._key(g, h)

    def _remember(self, tokens) -> None:
        for i, h in enumerate(self._chain(tokens)):
            prefix = tuple(tokens[:(i + 1) * self.bs])
            for g in range(self.G):
                got = self.seen.setdefault(self._key(g, h), (g, prefix))
                assert got == (g, prefix), "key collision across groups or prefixes"

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    def _visible_from(self, g: int, n: int) -> int:
        """First position a query at position >= n can still attend to in group g."""
        spec = self.specs[g]
        return 0 if spec.kind != "sliding" else max(0, n - spec.window + 1)

    def _start(self, g: int, n: int) -> int:
        return self.specs[g].first_needed_block(n, self.bs)

    def _refs(self) -> list[int]:
        return [b.ref_cnt for b in self.m.pool.blocks]

    def _tables(self, rid: str) -> list[list[int]]:
        return [list(self.m.block_ids(rid, g)) for g in range(self.G)]

    def _apply_copies(self, copies) -> None:
        for src, dst in copies:  # run in list order
            self.shadow[dst] = list(self.shadow[src])
        self.storage.copy_blocks(copies)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def _write(self, rid: str, start: int) -> None:
        """Write tokens[start:] of `rid` into every group at their slots, as the forward would."""
        bs, toks = self.bs, self.tokens[rid]
        for g in range(self.G):
            table = self.m.block_ids(rid, g)
            for pos in range(start, len(toks)):
                b = table[pos // bs]
                blk = self.m.pool.blocks[b]
                where = f"{rid} group {g} writes position {pos} into"
                assert not self._placeholder(b), f"{where} the null block"
                assert blk.ref_cnt == 1, f"{where} shared block {b} (ref {blk.ref_cnt})"
                assert blk.block_hash is None, f"{where} cached block {b}"
                self.shadow[b][pos % bs] = toks[pos]
            if start < len(toks):
                slots = torch.tensor([self._slot(table, p) for p in range(start, len(toks))])
                k = torch.tensor(toks[start:], dtype=torch.int64).view(-1, 1, 1)
                self.storage.write(g, slots, k, k + V_OFFSET)
        self._check_reads(rid, start)

    def _check_reads(self, rid: str, n_query: int) -> None:
        """Every token a query at position >= n_query can attend to reads back as written."""
        toks = self.tokens[rid]
        for g in range(self.G):
            table = self.m.block_ids(rid, g)
            pos = range(self._visible_from(g, n_query), len(toks))
            got = [self.shadow[table[p // self.bs]][p % self.bs] for p in pos]
            assert got == toks[pos.start:], f"{rid} group {g} reads {got} (table {table})"
            if pos:
                k, v = self.storage.read(g, torch.tensor([self._slot(table, p) for p in pos]))
                assert k.flatten().tolist() == got, f"{rid} group {g}: KVStorage K differs"
                assert (v.flatten() - V_OFFSET).tolist() == got, f"{rid} group {g}: KVStorage V differs"

    def _findable(self, g: int, h: bytes, tokens: tuple[int, ...]) -> bool:
        key = self._key(g, h)
        return any(blk.block_hash == key and blk.token_ids == tokens for blk in self.m.pool.blocks)

    def _check_hits(self, prompt, hits, num_hit) -> None:
        bs, pool = self.bs, self.m.pool
        assert len(hits) == self.G
        assert num_hit % bs == 0
        h = num_hit // bs
        if not self.m.enable_prefix_caching:
            assert hits == [[] for _ in range(self.G)] and num_hit == 0
            return
        max_blocks = max(0, (len(prompt) - 1) // bs)  # the last prompt token is always recomputed
        assert h <= max_blocks
        chain = self._chain(prompt)
        block = [tuple(prompt[i * bs:(i + 1) * bs]) for i in range(max_blocks)]
        for g, hg in enumerate(hits):
            assert len(hg) == h
            start = self._start(g, num_hit)
            assert all(self._placeholder(b) for b in hg[:start]), (g, hg)
            real = hg[start:]
            assert len(set(real)) == len(real)
            for i, b in enumerate(real, start):
                assert not self._placeholder(b), (g, i)
                blk = pool.blocks[b]
                assert blk.token_ids == block[i], (g, i, b)
                assert blk.block_hash == self._key(g, chain[i]), (g, i, b)
                assert self.shadow[b] == list(block[i]), f"hit block {b} holds {self.shadow[b]}"

        def usable(n):  # every group holds every block a query after n hit tokens needs
            return all(self._findable(g, chain[i], block[i])
                       for g in range(self.G) for i in range(self._start(g, n * bs), n))

        longest = max(n for n in range(max_blocks + 1) if n == 0 or usable(n))
        assert h == longest, f"hit {h} blocks, {longest} usable"

    def _admit(self, rid: str, prompt: list[int]) -> list[list[int]] | None:
        """get_computed_blocks + allocate_slots + write + cache_blocks; None if the pool is short."""
        m = self.m
        hits, num_hit = m.get_computed_blocks(rid, prompt)
        self._check_hits(prompt, hits, num_hit)
        before, refs0, queue0 = snapshot(m), self._refs(), list(m.pool.free_queue)
        if not m.allocate_slots(rid, num_hit, len(prompt) - num_hit, hits):
            assert snapshot(m) == before, "failed allocate_slots changed state"
            m.free(rid)
            assert rid not in m.reqs
            return None
        tables = self._tables(rid)
        real_hits = [b for hg in hits for b in hg if not self._placeholder(b)]
        fresh = []
        for g, table in enumerate(tables):
            assert table[:len(hits[g])] == hits[g]
            assert len(table) == self._blocks_for(len(prompt))
            fresh += table[len(hits[g]):]
        for b in set(real_hits):
            assert m.pool.blocks[b].ref_cnt == refs0[b] + real_hits.count(b), \
                f"hit block {b} was also handed out as a new block (tables {tables}, hits {hits})"
        for b in fresh:
            assert refs0[b] == 0 and b not in real_hits, f"block {b} handed out while owned or hit"
        if self.single:  # hits leave the queue; new blocks come off its front
            rest = [b for b in queue0 if b not in real_hits]
            assert fresh == rest[:len(fresh)], "new blocks not taken from the front of the LRU queue"
            assert list(m.pool.free_queue) == rest[len(fresh):]
        assert m.take_pending_copies() == []
        self.tokens[rid] = list(prompt)
        self._write(rid, num_hit)
        m.cache_blocks(rid, prompt, len(prompt))
        self._remember(prompt)
        return hits

    def _check_failed_alloc(self, rid: str, n0: int, before, tables0) -> None:
        if not any(s.kind == "sliding" for s in self.specs):
            assert snapshot(self.m) == before, "failed allocate_slots changed state"
            return
        # Sliding groups may drop out-of-window blocks first; nothing may be added.
        for g, (t0, t1) in enumerate(zip(tables0, self._tables(rid))):
            assert len(t1) == len(t0)
            for i, (a, b) in enumerate(zip(t0, t1)):
                assert a == b or (self._placeholder(b) and i < self._start(g, n0)), (g, i)
        assert self.m.pending_copies == before[5]

    def _step(self, batch: list[tuple[str, list[int]]]) -> None:
        """One engine step: allocate for every request, run all copies, then all writes."""
        m, bs = self.m, self.bs
        scheduled, copies_all = [], []
        for rid, extra in batch:
            n0 = len(self.tokens[rid])
            tables0, refs0, before = self._tables(rid), self._refs(), snapshot(m)
            queue0 = list(m.pool.free_queue)
            if not m.allocate_slots(rid, n0, len(extra)):
                self._check_failed_alloc(rid, n0, before, tables0)
                continue
            copies, tables = m.take_pending_copies(), self._tables(rid)
            idx, want, fresh = n0 // bs, [], []
            # Sliding groups first drop blocks out of every future query's window; the same call
            # may hand those straight out again.
            dropped = [b for g, t0 in enumerate(tables0) for b in t0[:self._start(g, n0)]
                       if not self._placeholder(b)]

            def was_free(b):
                return refs0[b] == dropped.count(b)
            for g, (t0, t1) in enumerate(zip(tables0, tables)):
                assert len(t1) == self._blocks_for(n0 + len(extra))
                start = self._start(g, n0)
                assert all(self._placeholder(b) for b in t1[:start]), (g, t1)  # out of window: dropped
                if n0 % bs and refs0[t0[idx]] > 1:  # partial last block shared: copy on write
                    old, new = t0[idx], t1[idx]
                    want.append((old, new))
                    assert was_free(new), f"copy target {new} was owned"
                    assert m.pool.blocks[old].ref_cnt == refs0[old] - 1
                    assert t1[start:idx] == t0[start:idx]
                    fresh.append(new)
                else:
                    assert t1[start:len(t0)] == t0[start:], (g, t0, t1)
                fresh += t1[len(t0):]
            assert copies == want, (copies, want)
            for b in fresh:
                assert was_free(b) and not self._placeholder(b), f"block {b} handed out while owned"
            if self.single:
                assert fresh == queue0[:len(fresh)], "new blocks not taken from the front of the LRU queue"
                assert list(m.pool.free_queue) == queue0[len(fresh):]
            copies_all += copies
            scheduled.append((rid, n0, extra))
        self._apply_copies(copies_all)
        for rid, n0, extra in scheduled:
            self.tokens[rid] = self.tokens[rid] + extra
            self._write(rid, n0)
        for rid, _, _ in scheduled:
            m.cache_blocks(rid, self.tokens[rid], len(self.tokens[rid]))
            self._remember(self.tokens[rid])

    def _free(self, rid: str) -> list[list[int]]:
        """Free `rid`, checking ref counts and where its blocks land in the LRU queue."""
        pool = self.m.pool
        refs0, queue0, tables = self._refs(), list(pool.free_queue), self._tables(rid)
        self.m.free(rid)
        owned = [b for t in tables for b in t if not self._placeholder(b)]
        for b in set(owned):
            assert pool.blocks[b].ref_cnt == refs0[b] - owned.count(b)
        released = [b for t in tables for b in reversed(t) if not self._placeholder(b) and refs0[b] == 1]
        if self.single:  # tail first; blocks without a hash to the front, cached ones to the back
            front = [b for b in reversed(released) if pool.blocks[b].block_hash is None]
            back = [b for b in released if pool.blocks[b].block_hash is not None]
            assert list(pool.free_queue) == front + queue0 + back, (tables, released)
        else:
            assert set(pool.free_queue) == set(queue0) | set(released)
        before = snapshot(self.m)
        self.m.free(rid)  # freeing again is a no-op
        assert snapshot(self.m) == before
        return tables

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="req")

    # ---- rules -----------------------------------------------------------------------
    @rule(prompt=PROMPT)
    def new_request(self, prompt):
        self._admit(self._new_id(), prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), keep=st.integers(0, 16), tail=st.lists(TOKEN, max_size=4))
    def new_request_sharing_prefix(self, data, keep, tail):
        """A prompt that starts like a live request's tokens (hits on owned blocks)."""
        prompt = self.tokens[self._pick(data)][:keep] + tail
        if prompt:
            self._admit(self._new_id(), prompt)

    @rule(prompts=st.lists(PROMPT, min_size=1, max_size=4), data=st.data(), tail=EXTRA)
    def churn(self, prompts, data, tail):
        """Requests of whole blocks come and go (filling the pool with free cached blocks), then a
        longer prompt reuses one of them: hits and new blocks drawn from a crowded LRU queue."""
        admitted = []
        for prompt in prompts:
            prompt = (prompt * self.bs)[:max(self.bs, len(prompt) // self.bs * self.bs)]
            rid = self._new_id()
            if self._admit(rid, prompt) is not None:
                admitted.append(rid)
        freed = [self.tokens[rid] for rid in admitted]
        for rid in data.draw(st.permutations(admitted), label="free order"):
            self._free(rid)
            del self.tokens[rid]
        if freed:
            self._admit(self._new_id(), data.draw(st.sampled_from(freed), label="reuse") + tail)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=EXTRA)
    def append(self, data, extra):
        self._step([(self._pick(data), extra)])

    @precondition(lambda self: len(self.tokens) >= 2)
    @rule(data=st.data())
    def batched_step(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=2, max_size=4,
                                  unique=True), label="batch")
        self._step([(rid, data.draw(EXTRA, label=rid)) for rid in rids])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src, dst = self._pick(data), self._new_id()
        refs0, tables = self._refs(), self._tables(src)
        self.m.fork(src, dst)
        assert self._tables(dst) == tables
        assert self.m.block_ids(dst) is not self.m.block_ids(src)
        owned = [b for t in tables for b in t if not self._placeholder(b)]
        for b in set(owned):
            assert self.m.pool.blocks[b].ref_cnt == refs0[b] + owned.count(b)
        assert self.m.take_pending_copies() == []
        self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), a=EXTRA, b=EXTRA, child_first=st.booleans(), same_step=st.booleans())
    def fork_and_diverge(self, data, a, b, child_first, same_step):
        """Fork, then both siblings append different tokens (copy-on-write of a partial block)."""
        src, dst = self._pick(data), self._new_id()
        self.m.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])
        batch = [(dst, b), (src, a)] if child_first else [(src, a), (dst, b)]
        if same_step:
            self._step(batch)
        else:
            for item in batch:
                self._step([item])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = self._pick(data)
        self._free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data):
        """Free a request (recompute preemption), then re-admit it with all its tokens."""
        rid = self._pick(data)
        toks = self.tokens.pop(rid)
        own = [self.m.pool.blocks[b].block_hash is not None for b in self.m.block_ids(rid)]
        tables0 = self._free(rid)
        hits = self._admit(rid, toks)
        if hits is not None and self.m.enable_prefix_caching and self.single:
            # Its own cached blocks are still findable right after the free.
            max_blocks = (len(toks) - 1) // self.bs
            run = 0
            while run < min(max_blocks, len(own)) and own[run]:
                run += 1
            assert len(hits[0]) >= run, (hits, tables0, own)
            assert hits[0][:run] == tables0[0][:run]

    @rule()
    def reset_prefix_cache(self):
        pool = self.m.pool
        free_cached = [b for b in pool.free_queue if pool.blocks[b].block_hash is not None]
        owned = {b.block_id: (b.block_hash, b.token_ids) for b in pool.blocks if b.ref_cnt > 0}
        assert self.m.reset_prefix_cache() == len(free_cached)
        assert all(pool.blocks[b].block_hash is None for b in pool.free_queue)
        assert {b.block_id: (b.block_hash, b.token_ids) for b in pool.blocks if b.ref_cnt > 0} == owned
        assert set(pool.cached.values()) == {b for b, (h, _) in owned.items() if h is not None}

    # ---- invariants ------------------------------------------------------------------
    @invariant()
    def refs_match_block_tables(self):
        pool, m = self.m.pool, self.m
        assert set(m.reqs) == set(self.tokens)
        count = [0] * pool.num_blocks
        for rid in m.reqs:
            owned = [b for t in self._tables(rid) for b in t if not self._placeholder(b)]
            assert len(set(owned)) == len(owned), f"{rid} holds a block twice: {self._tables(rid)}"
            for b in owned:
                count[b] += 1
        assert [b.ref_cnt for b in pool.blocks] == count
        idle = next((b.block_id for b in pool.blocks[pool.reserved:] if b.ref_cnt == 0), None)
        if idle is not None:  # a block no table holds cannot lose another reference
            with pytest.raises(RuntimeError, match="freed with ref_cnt 0"):
                pool.free([idle])
            assert pool.blocks[idle].ref_cnt == 0 and idle in pool.free_queue

    @invariant()
    def free_queue_is_exactly_unowned(self):
        pool = self.m.pool
        reserved = set(range(pool.reserved))
        unowned = {b.block_id for b in pool.blocks if b.ref_cnt == 0} - reserved
        assert set(pool.free_queue) == unowned
        assert all(pool.blocks[b].ref_cnt == 0 and pool.blocks[b].block_hash is None for b in reserved)
        owned = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free + owned == pool.num_usable
        assert pool.num_cached_free == sum(1 for b in unowned if pool.blocks[b].block_hash is not None)

    @invariant()
    def hash_map_names_true_tokens(self):
        pool, bs = self.m.pool, self.bs
        if not self.m.enable_prefix_caching:
            assert pool.cached == {}
        for key, b in pool.cached.items():
            blk = pool.blocks[b]
            assert blk.block_hash == key
            assert key in self.seen, f"block {b} cached under a key no token prefix produced"
            g, prefix = self.seen[key]
            assert self._key(g, self._chain(prefix)[-1]) == key
            assert blk.token_ids == prefix[-bs:], (b, blk.token_ids, prefix)
            assert self.shadow[b] == list(blk.token_ids), f"cached block {b} holds {self.shadow[b]}"
        for blk in pool.blocks:
            if blk.block_hash is None:
                assert blk.token_ids is None
            else:
                assert pool.cached.get(blk.block_hash) == blk.block_id

    @invariant()
    def request_hashes_name_its_tokens(self):
        bs = self.bs
        for rid, toks in self.tokens.items():
            state, chain = self.m.reqs[rid], self._chain(toks)
            assert state.block_hashes == chain[:len(state.block_hashes)], rid
            assert state.num_registered <= len(toks) // bs
            for g, table in enumerate(self._tables(rid)):
                for i, b in enumerate(table):
                    h = self.m.pool.blocks[b].block_hash
                    if not self._placeholder(b) and h is not None:
                        assert i < len(chain) and h == self._key(g, chain[i]), (rid, g, i, b)

    @invariant()
    def every_request_reads_back_its_tokens(self):
        for rid, toks in self.tokens.items():
            for g, table in enumerate(self._tables(rid)):
                assert len(table) == self._blocks_for(len(toks)), (rid, g)
                nulls = [i for i, b in enumerate(table) if self._placeholder(b)]
                assert nulls == list(range(len(nulls))), (rid, g, table)  # a leading run
                assert len(nulls) <= self._start(g, len(toks)), (rid, g, table)  # never a visible block
            self._check_reads(rid, len(toks))

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for rid in list(self.m.reqs):  # every request the manager knows of ends
            self.m.free(rid)
        self.tokens.clear()
        pool = self.m.pool
        assert self.m.reqs == {}
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.num_free == pool.num_usable
        uncached_free = sum(1 for b in pool.free_queue if pool.blocks[b].block_hash is None)
        assert uncached_free + pool.num_cached_free == pool.num_usable
        assert pool.num_cached_free == len(pool.cached)


KVManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=30, deadline=None,
    report_multiple_bugs=False,  # shrink one failure only: keeps a failing run short
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVManagerMachine = KVManagerMachine.TestCase
