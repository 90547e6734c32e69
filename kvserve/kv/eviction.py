"""The KV eviction strategy the KVCacheManager owns: what the manager, the model runner, the
engine and beam search ask of eviction, with keep-everything answers.

`KeepAll` is the strategy of an engine without a kv_policy. An engine started with one builds its
manager with kv/evictor.py's `Evictor` (per-request policy state, attention scores, compaction),
which answers the same calls. Callers hold no special cases: they always ask the manager's strategy.
"""

from __future__ import annotations


class KeepAll:
    """No entry is ever dropped: every group of a request holds all its computed tokens."""

    uniform = True              # every group holds num_computed_tokens entries for every request
    observed_groups: frozenset = frozenset()   # groups whose attention scores the strategy reads

    # ---- the manager's questions ------------------------------------------------------------
    def offsets(self, req_id: str) -> list[int] | None:
        """Entries dropped per group, or None when the request does not evict."""
        return None

    def hit_limit(self, req_id: str) -> int | None:
        """The most prompt tokens the request may take from the prefix cache (None: no limit)."""
        return None

    # ---- the model runner's ---------------------------------------------------------------------
    def cache_len(self, req, group: int) -> int:
        """Entries the group holds for the request."""
        return req.num_computed_tokens

    def position_shift(self, req) -> int:
        """How far the request's next positions are re-indexed down (window, sinks)."""
        return 0

    def score_hook(self, decodes, prefills):
        """A callback for attention to report scores through, or None."""
        return None

    # ---- the engine's -----------------------------------------------------------------------------
    def check(self, policy) -> None:
        """ValueError when a request's evicting `policy` cannot run in this engine."""
        raise ValueError(f"kv_policy {policy.spec()!r} needs an engine started with a kv_policy (any, 'full' "
                         "included: it gives every layer its own block table) and kv_cache_mode='paged'")

    def add(self, req, policy) -> None:
        """Track a request that runs under `policy`."""
        self.check(policy)

    def fork(self, parent, child) -> None:
        """`child` forks from `parent` and shares its cache."""

    def drop(self, req_id: str) -> None:
        """Forget a finished or aborted request."""

    def after_step(self, scheduled) -> None:
        """Apply policies now that the step's entries are in the cache."""

    def metrics(self) -> dict:
        return {}
