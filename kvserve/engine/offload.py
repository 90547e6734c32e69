"""Swap space and KV tiers wired into the engine: built from EngineConfig, reported in get_metrics."""

from __future__ import annotations

import logging
from pathlib import Path

from kvserve.kv.connector import ReceiveTier
from kvserve.kv.swap import SwapSpace
from kvserve.kv.tiers import (
    TIER_KINDS,
    TierBridge,
    TierEvents,
    fingerprint_path,
    make_tier,
    tier_namespace,
    tier_seal,
)

log = logging.getLogger("kvserve")
MIN_TIER_KEY_BYTES = 16


def build_swap(config, storage, kv) -> SwapSpace | None:
    """The host swap pool of `swap_space` GiB (None when 0 or without a KV cache)."""
    if not config.swap_space or not kv.holds_kv:
        return None
    per_block = storage.bytes_per_block
    num_blocks = int(config.swap_space * (1 << 30)) // per_block
    if num_blocks < 1:
        raise ValueError(f"swap_space={config.swap_space} GiB cannot hold one KV block ({per_block} bytes): raise it")
    swap = SwapSpace(storage, kv, num_blocks)
    log.info("swap space: %d blocks (%.2f GiB%s), preemption mode %s", num_blocks,
             num_blocks * per_block / (1 << 30), ", pinned" if swap.tensors[0].is_pinned() else "",
             config.preemption_mode)
    return swap


def kv_format_name(config, storage) -> str:
    """Everything about the KV storage format that decides what the bytes of a block mean."""
    fmt = getattr(storage, "format", None)
    if fmt is None:  # a storage without formats: the configured name is all there is
        return str(getattr(config, "kv_cache_dtype", "native"))
    slots = ";".join(",".join(e.name for e in s.entries) + ("+rotation" if s.rotation is not None else "")
                     for s in fmt.slots)
    return f"{fmt.description}|{slots}"


def check_tiers(specs: list, given) -> None:
    """ValueError unless each tier kind is named once (`given`: the kv_tiers option, for the message)."""
    kinds = [s.kind for s in specs]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"kv_tiers may name each kind (cpu, disk, redis) once, got {given}")


def tier_key(config) -> bytes | None:
    """The key of kv_tier_key or kv_tier_key_file as bytes (None without one); ValueError when the file
    cannot be read or the key is short. The key itself is never logged."""
    if config.kv_tier_key_file is not None:
        try:
            key = Path(config.kv_tier_key_file).read_bytes().rstrip(b"\r\n")
        except OSError as e:
            raise ValueError(f"cannot read kv_tier_key_file {config.kv_tier_key_file}: {e.strerror}") from None
        source = f"kv_tier_key_file {config.kv_tier_key_file}"
    elif config.kv_tier_key is not None:
        key, source = config.kv_tier_key.encode(), "kv_tier_key"
    else:
        return None
    if len(key) < MIN_TIER_KEY_BYTES:
        raise ValueError(f"the KV tier key ({source}) has {len(key)} bytes: give at least {MIN_TIER_KEY_BYTES}, "
                         "e.g. a file made by `openssl rand -hex 32`")
    return key


def build_tiers(planner, storage, pool, events=None) -> TierBridge | None:
    """The prefix-store tiers of `kv_tiers` over `storage` and the device `pool` (None without any);
    `events`: the KV events queue the tiers report into."""
    config = planner.config
    specs = config.tier_specs()
    transfer = config.kv_transfer_config
    if not specs and transfer is None:
        return None
    from kvserve.paths import default_cache_root
    weights = fingerprint_path(planner.loaded.path, default_cache_root() / "fingerprints")
    hash_algo = config.prefix_caching_hash_algo
    namespace = tier_namespace(weights=weights, dtype=planner.loaded.dtype,
                               kv_format=kv_format_name(config, storage), block_size=storage.block_size,
                               layer_specs=planner.groups, layout=storage.block_layout(), hash_algo=hash_algo)
    tier_events = TierEvents(events, namespace, hash_algo) if events is not None else None
    key = tier_key(config)
    front = [ReceiveTier(int(transfer.kv_buffer_size))] if transfer is not None and transfer.is_consumer else []
    bridge = TierBridge([*front, *(make_tier(s, tier_events) for s in specs)], storage, namespace, pool,
                        events=tier_events, seal=tier_seal(key, namespace))
    log.info("KV tiers: %s (namespace %s, entries %s)",
             ", ".join(f"{t.name} {t.write_policy}" for t in bridge.tiers) or "none (the KV connector's packing only)",
             namespace, "signed with the tier key (HMAC-SHA256)" if key is not None else "checksummed (CRC-32)")
    return bridge


def offload_metrics(engine) -> dict:
    """Swap usage and moves, preemptions by kind, prefix hits by source, per-tier counters."""
    swap, sched, kv = engine.swap, engine.scheduler, engine.kv
    m = {
        "swap_space_bytes": swap.num_blocks * swap.bytes_per_block if swap else 0,
        "swap_usage_bytes": swap.usage_bytes if swap else 0,
        "num_swapped_out_blocks": swap.num_swapped_out_blocks if swap else 0,
        "num_swapped_in_blocks": swap.num_swapped_in_blocks if swap else 0,
        "num_requests_swapped": len(swap.held) if swap else 0,
        "num_swap_preemptions": sched.num_swap_preemptions,
        "num_recompute_preemptions": sched.num_preemptions - sched.num_swap_preemptions,
    }
    by_source = {"device": 0, **{kind: 0 for kind in TIER_KINDS}}
    by_source.update(kv.stats.hits_by_source)
    m["prefix_cache_hits_by_source"] = by_source
    m["kv_tiers"] = engine.tiers.metrics() if engine.tiers is not None else {}
    return m
