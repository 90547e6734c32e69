"""KV eviction's engine glue: the policy a request runs under, the model facts the kv/ evictor is
built with, and RoPE tables long enough for streams that run past the trained context.

The strategy itself (per-request state, scores, compaction) is kv/evictor.py's `Evictor`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.kv.eviction import KeepAll
from kvserve.kv.evictor import Evictor
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.policies import KVPolicy
from kvserve.kv.spec import KVGroup
from kvserve.kv.storage import KVStorage


def evictor_factory(storage: KVStorage, model: torch.nn.Module,
                    groups: list[KVGroup]) -> Callable[[KVCacheManager], Evictor]:
    """What the KVCacheManager calls to build its Evictor: the storage, the groups, and from the
    model its head counts and each layer's key re-rotation (None where a layer has none)."""
    cfg = model.config
    shift_keys = [getattr(layer.self_attn, "shift_keys", None) for layer in model.model.layers]
    return lambda kv: Evictor(kv, storage, groups, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              shift_keys=shift_keys)


def request_policy(evictor: KeepAll, engine_policy: KVPolicy | None, params, prompt_len: int) -> KVPolicy | None:
    """The resolved policy a request runs under (its own, else the engine's), None when it keeps
    everything; ValueError when it cannot run here."""
    from kvserve.kv.policies import parse_policy
    policy = parse_policy(params.kv_policy) if params.kv_policy is not None else engine_policy
    if policy is None or not policy.evicts:
        return None
    policy = policy.resolve(prompt_len)
    evictor.check(policy)
    return policy


def extend_positions(model: torch.nn.Module, max_positions: int) -> None:
    """Grow every layer's RoPE tables to `max_positions` (a stream under a policy may run past the
    model's trained context; re-indexing policies never need it)."""
    for layer in model.model.layers:
        rope = getattr(layer.self_attn, "rope", None)
        if hasattr(rope, "extend"):
            rope.extend(max_positions)
