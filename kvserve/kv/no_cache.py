"""No-cache mode (kv_cache_mode='none'): a KV manager and storage that hold nothing.

Every step recomputes each request's whole sequence, so there is nothing to allocate, hash, share
or copy: every allocation succeeds without blocks, no prefix ever hits, usage is zero, block
tables are empty and free / cache / fork / pin do nothing. The engine, scheduler, runner, metrics
and server KV state ask these the same questions they ask a KVCacheManager and its KVStorage.
`holds_kv` (False here, True on KVCacheManager) is read once, where a part is built, by the
parts that run differently without a cache (the scheduler's whole-sequence steps, the runner's
prefill-only batch)."""

from __future__ import annotations

from kvserve.kv.block_stats import TimeHistogram
from kvserve.kv.eviction import KeepAll
from kvserve.kv.manager import PrefixCacheStats


class EmptyPool:
    """The block pool of no-cache mode: no blocks, nothing cached, nothing pinned."""

    num_blocks = num_usable = num_free = reserved = 0
    num_cached = num_cached_free = num_evicted = 0
    num_pinned = num_pinned_free = pin_limit = 0

    def __init__(self):
        self.blocks: list = []
        self.cached: dict = {}
        self.lifetime = TimeHistogram()
        self.reuse_gap = TimeHistogram()

    def pin_metrics(self) -> dict:
        """The pin counters, all zero."""
        return {"kv_pinned_blocks": 0, "kv_pinned_blocks_free": 0, "kv_pin_limit_blocks": 0,
                **{f"kv_pins_{k}": 0 for k in ("taken", "refused", "expired", "evicted")}}


class NoCacheManager:
    """The KV manager of no-cache mode: answers a KVCacheManager's calls, holding no blocks."""

    holds_kv = False
    block_size = 0
    enable_prefix_caching = False
    null = -1

    def __init__(self):
        self.groups: list = []       # no KV groups: a step's attention metadata has no backends
        self.pool = EmptyPool()
        self.reqs: dict = {}         # no request holds block tables
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0
        self.eviction = KeepAll()

    # ---- queries -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Usable blocks: none."""
        return 0

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """A request's block table: empty."""
        return []

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a sequence occupies: none."""
        return 0

    def max_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a lone sequence holds at most: none, so every request fits."""
        return 0

    def usage(self) -> float:
        """Fraction of the pool in use: always 0."""
        return 0.0

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int]) -> tuple[list[list[int]], int]:
        """No prefix is ever cached: no blocks, no hit tokens."""
        return [], 0

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int, hits=None) -> None:
        """Nothing is looked up, so nothing is counted."""

    def set_salt(self, req_id: str, salt: str | None) -> None:
        """No block is hashed: the salt has nothing to go into."""

    def set_retention(self, req_id: str, retention, num_prompt_tokens: int) -> None:
        """No block is kept: nothing to pin."""

    def drop_salt(self, req_id: str) -> None:
        """Nothing was kept for the request."""

    def drop_prefix(self, req_id: str) -> int:
        """No block was cached for the request: 0 dropped."""
        return 0

    def reset_prefix_cache(self, offload: bool = False) -> int:
        """No cached blocks to forget: 0."""
        return 0

    # ---- blocks --------------------------------------------------------------------
    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       hits=None) -> bool:
        """Always room: the step's K/V live only while it runs."""
        return True

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """No blocks fill up: nothing to register."""

    def free(self, req_id: str) -> None:
        """The request holds no blocks."""

    def fork(self, src_id: str, dst_id: str) -> None:
        """No blocks to share: the child recomputes its sequence as every request does."""

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """No copy-on-write copies: nothing is shared."""
        return []


class NoCacheStorage:
    """The KV storage of no-cache mode: no tensors, no bytes, nothing to copy."""

    block_size = 0
    nbytes = 0
    residual_nbytes = 0
    bytes_per_block = 0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """No blocks to copy."""
