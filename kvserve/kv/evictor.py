"""KV eviction: per-request policy state, attention scores, and compaction that frees blocks.

`Evictor` is the KVCacheManager's eviction strategy under a kv_policy (kv/eviction.py names the
calls it answers). Every KV group has its own block table per request, so each group may hold a
different set of tokens; the layers of one group keep the same tokens. For a request with a policy
(kv/policies.py) the evictor keeps, per group:

- `evicted[g]`: entries dropped so far. The group holds `num_computed_tokens - evicted[g]` entries
  (its *cache length*); the model runner builds slots and gather ranges from it, and the
  KVCacheManager sizes the table from it (`offsets`).
- `pos[g]`: the original token position of each entry, in cache order.
- `scores[g]`: attention the entries received, summed over the group's layers (H2O: summed over
  heads and queries, every step; SnapKV: per query head, from the last `window` prompt queries),
  filled by `score_hook` from inside attention (a math-path softmax next to the fused kernel, only
  for requests that need it).

After every step, `after_step` asks the policy which entries to keep, moves survivors into the
first ceil(kept / block_size) blocks of the group's table (in every layer of the group) and frees
the blocks behind them (`KVCacheManager.release_tail`). Blocks other holders see (forks, prefix
hits) are first swapped for private copies (`KVCacheManager.unshare`). Re-indexing policies
(window, sinks) keep order and re-rotate every moved key by the positions it moved (keys are stored
after RoPE; R(p - d) = R(-d) R(p) for rotate-half RoPE), and the next token's position is its cache
index (`position_shift`). Other policies keep original positions and fill the holes with entries
from the tail (fewest moves). Moves copy the raw per-token rows of every tensor of the storage slot
(`KVStorage.move_tokens`: lossless for any per-token format: float, fp8, int8, scales included);
re-rotated keys go through `KVStorage.read` / `write` (dequantize, rotate, quantize again: exact for
floats; for fp8/int8 the per-token absmax scale maps the codes back to themselves up to rounding).
KIVI formats are refused: their keys are quantized per channel over 32-token groups inside a block,
so moving single tokens between blocks would re-quantize whole groups.

Requests are the engine's (read: request_id, num_computed_tokens, num_prompt_tokens, is_finished);
what the model knows (head counts, each layer's key re-rotation) is handed in when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from kvserve.kv.eviction import KeepAll
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.policies import KVPolicy, snapkv_scores
from kvserve.kv.spec import KVGroup
from kvserve.kv.storage import KVStorage

KeyShift = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (cached keys, delta) -> keys moved delta back

SCORE_CHUNK = 256  # prefill queries per math-path softmax (bounds the [heads, chunk, context] tensor)


class _State:
    """One evicting request: its policy and, per KV group, what the cache holds."""

    def __init__(self, req, policy: KVPolicy, num_groups: int):
        self.req = req
        self.policy = policy
        self.num_groups = num_groups
        self.generator = torch.Generator().manual_seed(policy.seed)
        self.reset()

    def clone(self, req) -> "_State":
        """The same cache state for a fork `req` (its blocks are shared until eviction writes them)."""
        c = _State.__new__(_State)
        c.req, c.policy, c.num_groups = req, self.policy, self.num_groups
        c.generator = torch.Generator().set_state(self.generator.get_state())
        c.evicted, c.shift, c.done = list(self.evicted), self.shift, self.done
        c.pos = [p.clone() for p in self.pos]
        c.scores = [None if x is None else x.clone() for x in self.scores]
        return c

    def reset(self) -> None:
        """Nothing cached (a new request, or one preempted by recompute)."""
        g = self.num_groups
        self.evicted = [0] * g
        self.pos: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long) for _ in range(g)]
        self.scores: list[torch.Tensor | None] = [None] * g
        self.shift = 0          # positions re-indexed away (window, sinks)
        self.done = False       # one-shot policies: compressed already


class Evictor(KeepAll):
    """The KV manager's eviction strategy under a kv_policy (kv/eviction.py has the calls it answers);
    per-request state; see the module docstring."""

    uniform = False

    def __init__(self, kv: KVCacheManager, storage: KVStorage, groups: list[KVGroup], *, num_heads: int,
                 num_kv_heads: int, shift_keys: Sequence[KeyShift | None]):
        """`num_heads` / `num_kv_heads`: the model's query and KV heads; `shift_keys[layer]`: how the
        layer re-rotates cached keys (None: it cannot, so re-indexing policies are refused)."""
        if storage.has_residual:
            raise ValueError("kv_policy cannot be combined with a KIVI kv_cache_dtype (keys are quantized per "
                             "channel over 32-token groups, so single tokens cannot move between blocks); "
                             "use float16/bfloat16, fp8 or int8 with a kv_policy")
        self.kv, self.storage, self.groups = kv, storage, groups
        self.layer_group = {layer: i for i, g in enumerate(groups) for layer in g.layers}
        self.targets = [i for i, g in enumerate(groups) if not g.spec.keeps_window]  # sliding layers keep their window
        self.target_set = set(self.targets)
        self.observed_groups = frozenset(self.targets)
        self.has_other = len(self.targets) < len(groups)
        self.shift_keys = list(shift_keys)
        self.num_heads = num_heads
        # SnapKV averages scores over the query heads that share a key: all of them under MLA
        self.num_kv_heads = 1 if any(g.spec.latent for g in groups) else num_kv_heads
        self.states: dict[str, _State] = {}
        self.num_evicted_entries = 0   # token x layer
        self.num_evictions = 0
        self.num_blocks_freed = 0
        self.num_entries_moved = 0
        self.num_blocks_unshared = 0   # shared (forks, prefix hits) blocks copied before eviction wrote them
        self.num_deferred = 0          # evictions put off a step: no free block to unshare into

    # ---- requests ----------------------------------------------------------------------------
    def check(self, policy: KVPolicy) -> None:
        """ValueError when this model cannot run `policy`."""
        if not policy.evicts:
            return
        if not self.targets:
            raise ValueError(f"kv_policy {policy.spec()!r}: this model has no full-attention layers to evict from")
        if not policy.reindex:
            return
        if any(s is None for s in self.shift_keys):
            raise ValueError(f"kv_policy {policy.spec()!r} re-indexes positions, which needs RoPE keys that can "
                             "be re-rotated on every layer; use h2o or snapkv with this model")
        if any(not self.groups[g].spec.keeps_window for g in range(len(self.groups)) if g not in self.target_set):
            raise ValueError(f"kv_policy {policy.spec()!r}: every layer must be full or sliding-window attention")

    def add(self, req, policy: KVPolicy) -> None:
        """Track a request that runs under `policy` (resolved against its prompt)."""
        self.states[req.request_id] = _State(req, policy, len(self.groups))

    def fork(self, parent, child) -> None:
        """`child` forks from `parent` (n > 1): apply the parent's pending eviction first, so the
        children share the compressed prompt, then give the child a copy of the state."""
        st = self.states.get(parent.request_id)
        if st is not None:
            self._apply(st)
            self.states[child.request_id] = st.clone(child)

    def drop(self, req_id: str) -> None:
        """Forget a finished or aborted request."""
        self.states.pop(req_id, None)

    def _state(self, req_id: str) -> _State | None:
        st = self.states.get(req_id)
        if st is not None and st.req.num_computed_tokens == 0:
            st.reset()  # nothing is cached (new, or preempted by recompute): nothing is evicted
        return st

    # ---- lookups for the manager and the runner -------------------------------------------------
    def offsets(self, req_id: str) -> list[int] | None:
        """Entries dropped per group, or None when the request does not evict (manager hook)."""
        st = self._state(req_id)
        return None if st is None else st.evicted

    def hit_limit(self, req_id: str) -> int | None:
        """Prompt tokens the request may take from the prefix cache (manager hook): none for H2O
        (it scores every prompt query), all but SnapKV's observation window, any for the others."""
        st = self._state(req_id)
        if st is None or st.policy.scores is None:
            return None
        if st.policy.scores == "all":
            return 0
        return max(0, st.req.num_prompt_tokens - st.policy.window)

    def cache_len(self, req, g: int) -> int:
        """Entries group g holds for the request."""
        st = self._state(req.request_id)
        return req.num_computed_tokens - (st.evicted[g] if st is not None else 0)

    def position_shift(self, req) -> int:
        """How far the request's next positions are re-indexed down (window, sinks)."""
        st = self.states.get(req.request_id)
        return st.shift if st is not None else 0

    # ---- attention scores ------------------------------------------------------------------------
    def score_hook(self, decodes: list[tuple[object, int]], prefills: list[tuple[object, int]]):
        """The callback attention calls with every context of this batch, or None if no request needs it."""
        dec = [(i, st) for i, (r, n) in enumerate(decodes) if (st := self._scoring(r, n)) is not None]
        pre, row = {}, len(decodes)
        for r, n in prefills:
            st = self._scoring(r, n)
            if st is not None:
                pre[row] = (st, r.num_computed_tokens, n)
            row += n
        if not dec and not pre:
            return None
        return lambda layer, ctx, q, ks, scale: self._observe(layer, ctx, q, ks, scale, dec, pre)

    def _scoring(self, req, n: int) -> _State | None:
        st = self.states.get(req.request_id)
        if st is None or st.policy.scores is None:
            return None
        if st.policy.scores == "all":
            return st
        p = req.num_prompt_tokens
        start = req.num_computed_tokens
        wants = not st.done and p > st.policy.capacity and start < p and start + n > p - st.policy.window
        return st if wants else None

    def _observe(self, layer, ctx, q, ks, scale, dec, pre) -> None:
        g = self.layer_group.get(layer)
        if g not in self.target_set:
            return
        if ctx.batched:
            if dec:
                self._observe_decodes(g, q, ks, ctx.mask, scale, dec)
        elif ctx.rows.start in pre:
            st, start, n = pre[ctx.rows.start]
            self._observe_prefill(g, st, start, n, q, ks, ctx.mask, scale)

    def _observe_decodes(self, g, q, ks, mask, scale, dec) -> None:
        rows = torch.tensor([i for i, _ in dec], device=q.device)
        m, L = len(dec), ks.shape[1]
        hkv = ks.shape[2]
        qg = q[rows].float().view(m, hkv, -1, q.shape[-1])                       # [m, Hkv, G, D]
        logits = torch.einsum("mhgd,mlhd->mhgl", qg, ks[rows].float()) * scale   # [m, Hkv, G, L]
        logits = logits.masked_fill(~mask[rows].view(m, 1, 1, L), -math.inf)
        p = logits.softmax(-1).reshape(m, -1, L)                                  # [m, Hq, L]
        for j, (_, st) in enumerate(dec):
            n_ctx = st.req.num_computed_tokens - st.evicted[g] + 1   # this step's context in layer g
            self._accumulate_rows(st, g, p[j:j + 1, :, :n_ctx])

    def _observe_prefill(self, g, st: _State, start: int, n: int, q, ks, mask, scale) -> None:
        n_ctx = ks.shape[0]
        q0 = n_ctx - n                                          # cache index of the first query
        rows = torch.arange(n, device=q.device)
        if st.policy.scores == "window":
            rows = rows[start + rows >= st.req.num_prompt_tokens - st.policy.window]
        hkv = ks.shape[1]
        kf = ks.float()
        cols = torch.arange(n_ctx, device=q.device)
        for c in range(0, rows.numel(), SCORE_CHUNK):
            r = rows[c:c + SCORE_CHUNK]
            qg = q[r].float().view(r.numel(), hkv, -1, q.shape[-1])             # [c, Hkv, G, D]
            logits = torch.einsum("chgd,lhd->hgcl", qg, kf) * scale               # [Hkv, G, c, L]
            vis = mask[r] if mask is not None else cols[None, :] <= (q0 + r)[:, None]
            logits = logits.masked_fill(~vis, -math.inf)
            p = logits.softmax(-1).reshape(-1, r.numel(), n_ctx).transpose(0, 1)  # [c, Hq, L]
            self._accumulate_rows(st, g, p)

    def _accumulate_rows(self, st: _State, g: int, p: torch.Tensor) -> None:
        """p [c, Hq, L]: attention of c queries; H2O sums heads and queries, SnapKV keeps heads."""
        L = p.shape[-1]
        add = p.sum((0, 1)) if st.policy.scores == "all" else p.sum(0)
        st.scores[g] = _grown(st.scores[g], L, add)
        st.scores[g][..., :L] += add

    # ---- eviction ----------------------------------------------------------------------------------
    def after_step(self, scheduled: list[tuple[object, int]]) -> None:
        """Apply each scheduled request's policy now that its new entries are in the cache."""
        for req, _ in scheduled:
            st = self.states.get(req.request_id)
            if st is None:
                continue
            if req.is_finished:
                self.drop(req.request_id)
            else:
                self._apply(st)

    def _apply(self, st: _State) -> None:
        pol, req = st.policy, st.req
        if not pol.evicts or not self.kv.has_request(req.request_id):
            return
        if pol.one_shot and (st.done or req.num_computed_tokens < req.num_prompt_tokens):
            return
        todo = [g for g in self.targets if self.cache_len(req, g) > pol.capacity]
        if not self._unshare(st, todo):
            self.num_deferred += 1
            return
        st.done = pol.one_shot
        evicted = False
        for g in todo:
            n = self.cache_len(req, g)
            pos = self._positions(st, g, n)
            scores = None
            if pol.kind == "h2o":
                scores = _grown(st.scores[g], n)[..., :n].cpu()
            elif pol.kind == "snapkv":
                raw = _grown(st.scores[g], n, like=torch.zeros(self.num_heads, 0))[..., :n].cpu()
                scores = snapkv_scores(raw, pos, self.num_kv_heads, pol.kernel, pol.pool)
            self._compact(st, g, pos, pol.select(pos, scores, st.generator))
            evicted = True
        if pol.one_shot:
            st.scores = [None] * len(self.groups)
        if pol.reindex:
            shift = st.evicted[self.targets[0]]
            if shift > st.shift and self.has_other:
                self._shift_sliding(st, shift - st.shift)
            st.shift = shift
        self.num_evictions += evicted

    def _unshare(self, st: _State, groups: list[int]) -> bool:
        """Copy the blocks eviction may write (those that will hold kept entries, and the sliding
        layers' window when positions shift) that forks share or the prefix cache names (hits);
        False when the pool is short."""
        if not groups:
            return True
        rid = st.req.request_id
        kept = self.kv.blocks_for_tokens(st.policy.capacity)
        spans = [(g, kept) for g in groups]
        if st.policy.reindex:
            spans += [(g, len(self.kv.block_ids(rid, g))) for g in range(len(self.groups)) if g not in self.target_set]
        shared = [(g, i) for g, end in spans for i in self.kv.shared_indices(rid, g, end)]
        copies = self.kv.unshare(rid, shared, self.storage.copy_blocks)
        if copies is None:
            return False
        self.num_blocks_unshared += len(copies)
        return True

    def _positions(self, st: _State, g: int, n: int) -> torch.Tensor:
        """Original positions of the group's n entries (entries added since the last eviction are the
        newest tokens, in order)."""
        tracked = st.pos[g]
        m = n - tracked.numel()
        if m > 0:
            done = st.req.num_computed_tokens
            st.pos[g] = torch.cat([tracked, torch.arange(done - m, done)])
        return st.pos[g]

    def _compact(self, st: _State, g: int, pos: torch.Tensor, keep: torch.Tensor) -> None:
        """Move the kept entries into the first k cache indices, free the blocks behind them."""
        n, k = pos.numel(), keep.numel()
        if k == n:
            return
        rid = st.req.request_id
        if st.policy.reindex:
            dest = torch.arange(k)                     # keep order: rank = cache index = position
        else:
            dest = keep.clone()                        # fill holes below k with entries from the tail
            movers = keep >= k
            if bool(movers.any()):
                stays = torch.zeros(k, dtype=torch.bool)
                stays[keep[~movers]] = True
                dest[movers] = (~stays).nonzero().flatten()
        moved = dest != keep
        if bool(moved.any()):
            src, dst = keep[moved], dest[moved]
            if self.kv.shared_indices(rid, g, self.kv.blocks_for_tokens(k)):
                raise RuntimeError(f"request {rid}: eviction would write into a shared KV block")
            dev = self.storage.device
            src_slots = self.kv.slots(rid, g, src).to(dev)
            dst_slots = self.kv.slots(rid, g, dst).to(dev)
            for layer in self.groups[g].layers:
                if st.policy.reindex:
                    self._move_rotated(layer, src_slots, dst_slots, (src - dst).to(dev))
                else:
                    self.storage.move_tokens(layer, src_slots, dst_slots)
            self.num_entries_moved += int(moved.sum()) * len(self.groups[g].layers)
        new_pos = torch.empty(k, dtype=torch.long)
        new_pos[dest] = pos[keep]
        st.pos[g] = new_pos
        if st.scores[g] is not None:
            sc = _grown(st.scores[g], n)[..., :n]
            d = dest.to(sc.device)
            new = torch.zeros((*sc.shape[:-1], k), dtype=sc.dtype, device=sc.device)
            new[..., d] = sc[..., keep.to(sc.device)]
            st.scores[g] = new
        self.num_blocks_freed += self.kv.release_tail(rid, g, self.kv.blocks_for_tokens(k))
        st.evicted[g] += n - k
        self.num_evicted_entries += (n - k) * len(self.groups[g].layers)

    def _shift_sliding(self, st: _State, delta: int) -> None:
        """Re-index the keys sliding-window layers still attend over by `delta` positions, as the
        full layers' compaction just did for theirs (hybrid models: window/sinks policies)."""
        req, dev = st.req, self.storage.device
        for g in range(len(self.groups)):
            if g in self.target_set:
                continue
            n = self.cache_len(req, g)
            start = max(0, n + 1 - self.groups[g].spec.visible_window)   # what the next query will see
            slots = self.kv.slots(req.request_id, g, torch.arange(start, n)).to(dev)
            shift = torch.full((n - start,), delta, device=dev)
            for layer in self.groups[g].layers:
                self._move_rotated(layer, slots, slots, shift)
            self.num_entries_moved += (n - start) * len(self.groups[g].layers)

    def _move_rotated(self, layer: int, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor) -> None:
        """Entries at src -> dst with keys re-rotated `delta` positions back."""
        k, *rest = self.storage.read(layer, src)     # K [m, kv_heads, head_dim] and V, or the MLA latent
        rot = self.storage.rotation(layer)
        if rot is not None:
            k = k @ rot.mT
        k = self.shift_keys[layer](k, delta)
        if rot is not None:
            k = k @ rot
        self.storage.write(layer, dst, k, *rest)

    # ---- numbers -------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Evicted entries (token x layer), the same in tokens per evicting layer, events, blocks freed."""
        per_layer = max(1, sum(len(self.groups[g].layers) for g in self.targets))
        return {
            "kv_evicted_tokens": self.num_evicted_entries // per_layer,
            "kv_evicted_entries": self.num_evicted_entries,
            "kv_evictions": self.num_evictions,
            "kv_eviction_blocks_freed": self.num_blocks_freed,
            "kv_eviction_entries_moved": self.num_entries_moved,
            "kv_eviction_blocks_unshared": self.num_blocks_unshared,
            "kv_evictions_deferred": self.num_deferred,
            "kv_requests_evicting": sum(1 for s in self.states.values() if s.policy.evicts),
        }

    def blocks_held(self, req_id: str) -> int:
        """Blocks the request holds over all groups (the pool's view of its KV memory)."""
        return self.kv.blocks_held(req_id)


def _grown(t: torch.Tensor | None, n: int, add: torch.Tensor | None = None,
           like: torch.Tensor | None = None) -> torch.Tensor:
    """`t` zero-padded on its last dim to length >= n (created from `add` / `like` when None)."""
    if t is None:
        ref = add if add is not None else like if like is not None else torch.zeros(0)
        return torch.zeros((*ref.shape[:-1], n), dtype=torch.float32, device=ref.device)
    if t.shape[-1] >= n:
        return t
    pad = torch.zeros((*t.shape[:-1], n - t.shape[-1]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=-1)
