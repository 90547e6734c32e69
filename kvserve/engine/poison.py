"""Poisoned prefixes: a request whose logits came out NaN or infinite had its cache read or written wrong.

Sampling parameters act on a copy of the logits, so a row of the model's own logits that is not
finite points at the model or at the K/V it attended over: a cached block of its prefix (a corrupt
or forged tier entry, say) or a block it wrote from one. Left in the cache, such a block fails every request that
reads it, on every engine sharing the tier. So the request's prefix — every block it read from the
prefix cache or registered in it — is evicted from the device and from every tier
(KVCacheManager.drop_prefix), counted and logged; a retry recomputes it. A failure that followed
a cached prefix is the prefix's, not the engine's (`prefix_fault` on the output: the server's
two-steps-in-a-row rule does not count it).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("kvserve")


class PoisonedPrefixes:
    """Evicts the prefix of a request whose logits row is not finite; counts what it evicted."""

    def __init__(self, kv):
        self.kv = kv
        self.blocks_evicted = 0   # device blocks dropped (tier entries: each tier's `poisoned`)
        self.prefix_failures = 0  # requests failed after reading a cached prefix

    def evict(self, req, row: torch.Tensor) -> str | None:
        """Evict `req`'s prefix if its logits `row` is not finite; the error to fail it with when the
        failure follows a cached prefix, None otherwise (the caller's own message applies)."""
        if bool(torch.isfinite(row).all()):
            return None   # finite logits: the sampling parameters left nothing to draw
        n = self.kv.drop_prefix(req.request_id)
        self.blocks_evicted += n
        cached = req.num_cached_tokens
        if n or cached:
            log.warning("request %s: the model's logits were NaN or infinite after %d cached prompt tokens; "
                        "evicted its prefix (%d device blocks) from the device and the KV tiers",
                        req.request_id, cached, n)
        if not cached:
            return None
        self.prefix_failures += 1
        return (f"no token could be drawn: the model's logits were NaN or infinite after reading {cached} "
                "cached prompt tokens, so the cached prefix was evicted from the device and the KV tiers as "
                "poisoned; retry and it is recomputed")

    def metrics(self) -> dict:
        """The counters, for get_metrics()."""
        return {"kv_poisoned_blocks_evicted": self.blocks_evicted,
                "kv_poisoned_prefix_failures": self.prefix_failures}
