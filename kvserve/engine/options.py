"""The options an engine is built from: EngineConfig's own checks, then each subsystem's check of
the options it understands, before anything loads; the checked config comes back normalised, once."""

from __future__ import annotations

import dataclasses

from kvserve.attention.invariant import check_options as check_batch_invariant
from kvserve.config import EngineConfig
from kvserve.engine.offload import check_tiers, tier_key
from kvserve.engine.spec.config import check_combination, parse_speculative_config
from kvserve.kv.connector import parse_kv_transfer_config
from kvserve.kv.events import check_endpoint
from kvserve.kv.formats import format_options
from kvserve.kv.hashing import digest_fn
from kvserve.kv.policies import parse_policy


def engine_options(config: EngineConfig) -> EngineConfig:
    """A checked copy of `config` with normalised values (byte sizes, canonical KV format names, the
    block size, the tier list); ValueError naming the first bad option. `config` is left as it is."""
    config.validate()
    fmt = format_options(config.kv_cache_dtype, config.kv_cache_dtype_k, config.kv_cache_dtype_v,
                         config.kv_cache_dtype_skip_layers, config.kv_cache_rotation,
                         config.kv_cache_head_precision, config.kv_cache_head_precision_dtype,
                         config.block_size, config.kv_cache_mode)
    check_tiers(config.tier_specs(), config.kv_tiers)
    tier_key(config)   # a key file that cannot be read, or a short key, fails now
    if config.kv_policy is not None:
        parse_policy(config.kv_policy)
    check_endpoint("kv_events", config.kv_events, config.kv_events_allow_remote)
    check_endpoint("kv_events_replay", config.kv_events_replay, config.kv_events_allow_remote)
    digest_fn(config.prefix_caching_hash_algo)  # names the choices, or says to pip install xxhash
    check_batch_invariant(config)
    checked = dataclasses.replace(config, **dataclasses.asdict(fmt),
                                  kv_cache_memory=config.kv_cache_memory_bytes(),
                                  kv_tiers=config.tier_names() if config.kv_tiers is not None else None,
                                  speculative_config=parse_speculative_config(config.speculative_config),
                                  kv_transfer_config=parse_kv_transfer_config(config.kv_transfer_config))
    if checked.kv_transfer_config is not None:
        check_transfer(checked)
    if checked.speculative_config is not None:
        check_combination(checked, checked.speculative_config)
    return checked


def check_transfer(config: EngineConfig) -> None:
    """ValueError for an option a KV connector cannot run with (it moves whole blocks of the paged,
    prefix-cached pool, named by their hashes)."""
    refused = {"kv_cache_mode='none' (no cache to move)": config.kv_cache_mode != "paged",
               "prefix caching off (a consumer loads received blocks through the prefix lookup)":
                   not config.enable_prefix_caching,
               "kv_policy (evicted tokens leave blocks a consumer cannot rebuild)": config.kv_policy is not None,
               "tensor_parallel_size > 1 (each rank holds part of every block)": config.tensor_parallel_size > 1}
    extra = config.kv_transfer_config.kv_connector_extra_config
    if config.kv_transfer_config.kv_connector == "TierConnector" and config.parse_tier(extra["tier"]).kind == "cpu":
        raise ValueError("TierConnector needs a tier two engines share (redis or disk), not cpu")
    bad = [what for what, hit in refused.items() if hit]
    if bad:
        raise ValueError(f"kv_transfer_config cannot run with {bad[0]}: leave one of them out")
