"""Stateful property tests of the KV cache: KVCacheManager over a BlockPool, with KVStorage as data.

A Hypothesis state machine admits, grows, forks, frees, preempts and re-admits requests over a small
pool, runs the copy-on-write copies and writes every new token into both a shadow model (a dict
block -> slots) and a real KVStorage, and after every rule checks the pool's bookkeeping and that
every request reads back exactly its own tokens.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kv.hashing import hash_full_blocks, namespace_hash
from kvserve.kv.manager import KVCacheManager
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


def snapshot(m: KVCacheManager):
    """Everything allocate_slots may touch, as plain comparable values."""
    pool = m.pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
        list(pool.free_queue),
        dict(pool.cached),
        pool.num_evicted,
        {rid: (list(s.block_ids), list(s.block_hashes), s.num_registered) for rid, s in m.reqs.items()},
        list(m.pending_copies),
    )


class KVManagerMachine(RuleBasedStateMachine):
    """Model: self.tokens[rid] = the tokens whose K/V the request has computed (and written)."""

    @initialize(num_blocks=st.integers(8, 32), block_size=st.integers(2, 4),
                prefix_caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks, block_size, prefix_caching):
        self.bs = block_size
        self.m = KVCacheManager(num_blocks, block_size, NS, enable_prefix_caching=prefix_caching)
        self.storage = KVStorage(1, num_blocks, block_size, 1, 1, torch.int64)
        for t in self.storage.k + self.storage.v:
            t.fill_(EMPTY)
        self.shadow = {b: [EMPTY] * block_size for b in range(num_blocks)}
        self.tokens: dict[str, list[int]] = {}
        self.seen: dict[bytes, tuple[int, ...]] = {}  # chained hash -> the token prefix it names
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _chain(self, tokens) -> list[bytes]:
        return hash_full_blocks(NS, list(tokens), self.bs)

    def _remember(self, tokens) -> None:
        for i, h in enumerate(self._chain(tokens)):
            prefix = tuple(tokens[:(i + 1) * self.bs])
            assert self.seen.setdefault(h, prefix) == prefix, "hash collision in the model"

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    def _refs(self) -> list[int]:
        return [b.ref_cnt for b in self.m.pool.blocks]

    def _apply_copies(self, copies) -> None:
        for src, dst in copies:  # run in list order
            self.shadow[dst] = list(self.shadow[src])
        self.storage.copy_blocks(copies)

    def _write(self, rid: str, start: int) -> None:
        """Write tokens[start:] of `rid` at their slots, as the model's forward would."""
        bs, table, toks = self.bs, self.m.block_ids(rid), self.tokens[rid]
        slots = []
        for pos in range(start, len(toks)):
            b = table[pos // bs]
            blk = self.m.pool.blocks[b]
            assert blk.ref_cnt == 1, f"{rid} writes position {pos} into shared block {b} (ref {blk.ref_cnt})"
            assert blk.block_hash is None, f"{rid} writes position {pos} into cached block {b}"
            self.shadow[b][pos % bs] = toks[pos]
            slots.append(b * bs + pos % bs)
        if slots:
            k = torch.tensor(toks[start:], dtype=torch.int64).view(-1, 1, 1)
            self.storage.write(0, torch.tensor(slots), k, k + V_OFFSET)

    def _check_hits(self, prompt, hits, num_hit) -> None:
        bs, pool = self.bs, self.m.pool
        assert num_hit == len(hits) * bs
        assert len(set(hits)) == len(hits)
        if not self.m.enable_prefix_caching:
            assert hits == []
            return
        max_blocks = (len(prompt) - 1) // bs  # the last prompt token is always recomputed
        assert len(hits) <= max_blocks
        chain = self._chain(prompt)
        for i, b in enumerate(hits):
            want = prompt[i * bs:(i + 1) * bs]
            assert pool.blocks[b].token_ids == tuple(want), (i, b)
            assert pool.blocks[b].block_hash == chain[i], (i, b)
            assert self.shadow[b] == want, f"hit block {b} holds {self.shadow[b]}, not {want}"
        if len(hits) < max_blocks:  # longest: the next block is cached nowhere
            i = len(hits)
            nxt = (chain[i], tuple(prompt[i * bs:(i + 1) * bs]))
            assert not any((blk.block_hash, blk.token_ids) == nxt for blk in pool.blocks), i

    def _admit(self, rid: str, prompt: list[int]) -> list[int] | None:
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
        table = m.block_ids(rid)
        assert table[:len(hits)] == hits
        assert len(table) == self._blocks_for(len(prompt))
        for b in hits:
            assert m.pool.blocks[b].ref_cnt == refs0[b] + 1
        for b in table[len(hits):]:
            assert refs0[b] == 0, f"block {b} handed out while owned"
        rest = [b for b in queue0 if b not in hits]  # hits leave the queue; new blocks come off its front
        fresh = len(table) - len(hits)
        assert table[len(hits):] == rest[:fresh], "new blocks not taken from the front of the LRU queue"
        assert list(m.pool.free_queue) == rest[fresh:]
        assert m.take_pending_copies() == []
        self.tokens[rid] = list(prompt)
        self._write(rid, num_hit)
        m.cache_blocks(rid, prompt, len(prompt))
        self._remember(prompt)
        return hits

    def _step(self, batch: list[tuple[str, list[int]]]) -> None:
        """One engine step: allocate for every request, run all copies, then all writes."""
        m, bs = self.m, self.bs
        scheduled, copies_all = [], []
        for rid, extra in batch:
            n0 = len(self.tokens[rid])
            table0, refs0, before = list(m.block_ids(rid)), self._refs(), snapshot(m)
            queue0 = list(m.pool.free_queue)
            if not m.allocate_slots(rid, n0, len(extra)):
                assert snapshot(m) == before, "failed allocate_slots changed state"
                continue
            copies = m.take_pending_copies()
            table = m.block_ids(rid)
            assert len(table) == self._blocks_for(n0 + len(extra))
            idx = n0 // bs
            if n0 % bs and refs0[table0[idx]] > 1:  # partial last block shared: copy on write
                old, new = table0[idx], table[idx]
                assert copies == [(old, new)], (copies, old, new)
                assert refs0[new] == 0, f"copy target {new} was owned"
                assert m.pool.blocks[old].ref_cnt == refs0[old] - 1
                assert table[:idx] == table0[:idx]
            else:
                assert copies == [], copies
                assert table[:len(table0)] == table0
            for b in table[len(table0):]:
                assert refs0[b] == 0, f"block {b} handed out while owned"
            fresh = [dst for _, dst in copies] + table[len(table0):]  # copy target first, then growth
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

    def _free(self, rid: str) -> list[int]:
        """Free `rid`, checking ref counts and where its blocks land in the LRU queue."""
        pool = self.m.pool
        refs0, queue0, table = self._refs(), list(pool.free_queue), list(self.m.block_ids(rid))
        self.m.free(rid)
        for b in table:
            assert pool.blocks[b].ref_cnt == refs0[b] - 1
        released = [b for b in reversed(table) if refs0[b] == 1]  # tail first
        front = [b for b in reversed(released) if pool.blocks[b].block_hash is None]
        back = [b for b in released if pool.blocks[b].block_hash is not None]
        assert list(pool.free_queue) == front + queue0 + back, (table, released)
        before = snapshot(self.m)
        self.m.free(rid)  # freeing again is a no-op
        assert snapshot(self.m) == before
        return table

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
        refs0, table = self._refs(), list(self.m.block_ids(src))
        self.m.fork(src, dst)
        assert self.m.block_ids(dst) == table
        assert self.m.block_ids(dst) is not self.m.block_ids(src)
        for b in table:
            assert self.m.pool.blocks[b].ref_cnt == refs0[b] + 1
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
        table0 = self._free(rid)
        hits = self._admit(rid, toks)
        if hits is not None and self.m.enable_prefix_caching:
            # Its own cached blocks are still findable right after the free.
            max_blocks = (len(toks) - 1) // self.bs
            run = 0
            while run < min(max_blocks, len(own)) and own[run]:
                run += 1
            assert len(hits) >= run, (hits, table0, own)
            assert hits[:run] == table0[:run]

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
            table = m.block_ids(rid)
            assert len(set(table)) == len(table), f"{rid} holds a block twice: {table}"
            for b in table:
                count[b] += 1
        assert [b.ref_cnt for b in pool.blocks] == count
        assert min(count) >= 0

    @invariant()
    def free_queue_is_exactly_unowned(self):
        pool = self.m.pool
        unowned = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert set(pool.free_queue) == unowned
        owned = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free + owned == pool.num_blocks
        assert pool.num_cached_free == sum(1 for b in unowned if pool.blocks[b].block_hash is not None)

    @invariant()
    def hash_map_names_true_tokens(self):
        pool, bs = self.m.pool, self.bs
        if not self.m.enable_prefix_caching:
            assert pool.cached == {}
        for h, b in pool.cached.items():
            blk = pool.blocks[b]
            assert blk.block_hash == h
            assert h in self.seen, f"block {b} cached under a hash no token prefix produced"
            prefix = self.seen[h]
            assert self._chain(prefix)[-1] == h
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
            for i, b in enumerate(state.block_ids):
                h = self.m.pool.blocks[b].block_hash
                assert h is None or (i < len(chain) and h == chain[i]), (rid, i, b)

    @invariant()
    def every_request_reads_back_its_tokens(self):
        bs = self.bs
        for rid, toks in self.tokens.items():
            table = self.m.block_ids(rid)
            assert len(table) == self._blocks_for(len(toks)), rid
            got = [self.shadow[table[p // bs]][p % bs] for p in range(len(toks))]
            assert got == toks, f"{rid} reads {got}, wrote {toks} (table {table})"
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(toks))])
            k, v = self.storage.read(0, slots)
            assert k.flatten().tolist() == toks, f"{rid}: KVStorage K differs from shadow"
            assert (v.flatten() - V_OFFSET).tolist() == toks, f"{rid}: KVStorage V differs"

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for rid in list(self.tokens):
            self.m.free(rid)
        self.tokens.clear()
        pool = self.m.pool
        assert self.m.reqs == {}
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.num_free == pool.num_blocks
        uncached_free = sum(1 for b in pool.free_queue if pool.blocks[b].block_hash is None)
        assert uncached_free + pool.num_cached_free == pool.num_blocks
        assert pool.num_cached_free == len(pool.cached)


KVManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVManagerMachine = KVManagerMachine.TestCase
