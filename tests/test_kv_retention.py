"""Retention pins: a pinned prefix is evicted last, expires, and stays within its share of the pool."""

from __future__ import annotations

import math

import pytest

from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.sampling_params import KVRetention, SamplingParams

NS = namespace_hash("unit-model", "float16", "kv-retention")
BS = 4


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 12, pin_fraction: float = 0.5) -> tuple[KVCacheManager, Clock]:
    m = KVCacheManager(num_blocks, BS, NS, pin_fraction=pin_fraction)
    clock = Clock()
    m.pool.clock = clock
    return m, clock


def run(m: KVCacheManager, rid: str, tokens: list[int], retention: KVRetention | None = None) -> int:
    """Admit, cache and finish one request; returns its prefix-hit tokens."""
    m.set_retention(rid, retention, len(tokens))
    hits, num_hit = m.get_computed_blocks(rid, tokens)
    assert m.allocate_slots(rid, num_hit, len(tokens) - num_hit, hits)
    m.cache_blocks(rid, tokens, len(tokens))
    m.free(rid)
    return num_hit


def prompt(seed: int, blocks: int = 3) -> list[int]:
    """A prompt of `blocks` full blocks plus one token, distinct per seed."""
    return [seed * 1000 + i for i in range(blocks * BS + 1)]


def flood(m: KVCacheManager, n: int, start: int = 100) -> None:
    for k in range(n):
        run(m, f"flood{k}", prompt(start + k))


def all_free(m: KVCacheManager) -> bool:
    pool = m.pool
    return pool.num_free == pool.num_usable and all(b.ref_cnt == 0 for b in pool.blocks)


def test_pinned_prefix_survives_a_flood_that_evicts_an_unpinned_one():
    m, _ = make()
    pinned, plain = prompt(1), prompt(2)
    run(m, "p", pinned, KVRetention(priority=80))
    run(m, "u", plain)
    assert m.pool.num_pinned == 3
    flood(m, 6)  # 24 blocks through a pool of 12
    assert run(m, "p2", pinned) == 3 * BS
    assert run(m, "u2", plain) == 0
    assert m.pool.pin_counts["taken"] == 3 and m.pool.pin_counts["evicted"] == 0
    assert all_free(m)


def test_expired_pin_is_evicted_like_any_block():
    m, clock = make()
    pinned = prompt(1)
    run(m, "p", pinned, KVRetention(priority=80, ttl_s=30.0))
    clock.now += 10
    flood(m, 6)
    assert run(m, "p2", pinned) == 3 * BS  # still pinned after 10 s
    clock.now += 31                        # the pin set at t=100 ended at t=130
    flood(m, 6, start=200)
    assert run(m, "p3", pinned) == 0
    assert m.pool.pin_counts["expired"] == 3 and m.pool.num_pinned == 0
    assert all_free(m)


def test_a_later_request_refreshes_the_pin():
    m, clock = make()
    pinned = prompt(1)
    run(m, "p", pinned, KVRetention(priority=10, ttl_s=30.0))
    clock.now += 20
    assert run(m, "p2", pinned, KVRetention(priority=90, ttl_s=30.0)) == 3 * BS  # pin now ends at t=150
    clock.now += 20
    flood(m, 6)
    assert run(m, "p3", pinned) == 3 * BS
    priorities = [b.pin_priority for b in m.pool.blocks if b.pin_priority is not None]
    assert priorities == [90] * 3 and m.pool.pin_counts["taken"] == 3


def test_pins_beyond_the_share_are_refused_and_counted():
    m, _ = make(num_blocks=12, pin_fraction=0.25)  # 3 blocks may be pinned
    run(m, "a", prompt(1), KVRetention())
    run(m, "b", prompt(2), KVRetention())
    pool = m.pool
    assert pool.pin_limit == 3 and pool.num_pinned == 3
    assert pool.pin_counts["taken"] == 3 and pool.pin_counts["refused"] == 3
    assert pool.pin_metrics()["kv_pins_refused"] == 3
    flood(m, 6)
    assert run(m, "a2", prompt(1)) == 3 * BS and run(m, "b2", prompt(2)) == 0


def test_max_tokens_pins_only_the_leading_blocks():
    m, _ = make()
    run(m, "a", prompt(1), KVRetention(max_tokens=2 * BS + 1))
    assert m.pool.num_pinned == 2
    flood(m, 6)
    assert run(m, "a2", prompt(1)) == 2 * BS


def test_only_pinned_free_blocks_left_still_serve_a_request_lowest_priority_first():
    m, _ = make(num_blocks=8, pin_fraction=1.0)
    run(m, "low", prompt(1, blocks=2), KVRetention(priority=10))
    run(m, "high", prompt(2, blocks=2), KVRetention(priority=90))
    run(m, "mid", prompt(3, blocks=2), KVRetention(priority=50))
    # 6 pinned free blocks, 2 unpinned: a 5-block request takes the 2 unpinned, then low's 2, then one of mid's
    assert m.pool.num_pinned_free == 6 and m.pool.num_free == 8
    assert m.allocate_slots("big", 0, 5 * BS)
    assert m.pool.pin_counts["evicted"] == 3
    m.free("big")
    assert run(m, "high2", prompt(2, blocks=2)) == 2 * BS
    assert run(m, "low2", prompt(1, blocks=2)) == 0
    assert m.pool.num_pinned == 2 + 1 and all_free(m)


def test_pool_full_of_pinned_blocks_never_blocks_admission():
    m, _ = make(num_blocks=8, pin_fraction=1.0)
    for k in range(4):
        run(m, f"p{k}", prompt(k + 1, blocks=2)[:-1], KVRetention(priority=k))  # exactly 2 blocks
    assert m.pool.num_pinned == 8 and m.pool.num_free == 8
    tokens = list(range(5000, 5000 + 8 * BS))
    assert m.allocate_slots("whole", 0, len(tokens))  # the whole pool, pins or not
    assert m.pool.num_pinned == 0 and m.pool.num_free == 0
    m.free("whole")
    assert all_free(m)


def test_reset_prefix_cache_drops_pins():
    m, _ = make()
    run(m, "a", prompt(1), KVRetention())
    assert m.reset_prefix_cache() == 3
    assert m.pool.num_pinned == 0 and run(m, "a2", prompt(1)) == 0 and all_free(m)


@pytest.mark.parametrize("bad", [
    {"priority": 101}, {"priority": -1}, {"priority": True}, {"ttl_s": 0}, {"ttl_s": math.inf},
    {"max_tokens": 0}, {"lifetime": 3}, "pin",
])
def test_bad_retention_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="kv_retention"):
        SamplingParams(kv_retention=bad)


def test_retention_from_a_dict():
    p = SamplingParams(kv_retention={"priority": 70, "ttl_s": 5})
    assert p.kv_retention == KVRetention(priority=70, ttl_s=5.0, max_tokens=None)


def test_pinned_blocks_reach_a_write_back_tier_when_pinned():
    from test_tiers import run_request, tiered_cache

    from kvserve.kv.tiers import CpuTier

    back = CpuTier(1 << 20)
    kv, storage, bridge = tiered_cache([back])  # 8 blocks, 4 may be pinned
    run_request(kv, storage, "plain", list(range(900, 909)), seed=0)  # 2 full blocks, no pin
    kv.set_retention("a", KVRetention(), 13)
    run_request(kv, storage, "a", list(range(100, 113)), seed=1)       # 3 full blocks, pinned
    bridge.write_through()
    assert bridge.flush(timeout=10)
    assert back.stats.entries_written == 3 and kv.pool.num_pinned == 3  # written when pinned, not evicted yet
    run_request(kv, storage, "b", list(range(500, 520)), seed=2)       # 5 blocks: evicts the unpinned ones
    bridge.write_through()
    assert bridge.flush(timeout=10)
    assert back.stats.entries_written == 3 + 2                         # the plain blocks on eviction; pins once


# ---- end to end: an agent's context comes back after other traffic --------------------------------
POOL_20 = 20 * 16 * 46080  # 20 blocks of SmolLM2 in float32
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def test_agent_context_pinned_survives_other_traffic_and_matches_recompute(llm_nocache):
    from pydoc_data.topics import topics

    from kvserve import LLM

    llm = LLM(kv_cache_memory=POOL_20, max_model_len=256, dtype="float32", kv_pin_fraction=0.75)
    ids = llm.get_tokenizer().encode(topics["assignment"] + topics["compound"])
    context, plain = ids[:161], ids[2000:2081]          # 10 and 5 full blocks
    pin = SamplingParams(temperature=0, max_tokens=4, kv_retention={"priority": 90, "ttl_s": 600})
    llm.generate([context], pin, use_tqdm=False)
    llm.generate([plain], GREEDY, use_tqdm=False)
    for k in range(3):                                  # other traffic: 3 x 6 blocks through 10 unpinned ones
        llm.generate([ids[3000 + 100 * k:3000 + 100 * k + 81]], GREEDY, use_tqdm=False)
    kv = llm.engine.kv
    hits, _ = kv.get_computed_blocks("probe", plain)
    kv.free("probe")
    assert hits == [[]]                                 # the unpinned prompt is gone
    follow_up = context + ids[5000:5009]                # the context comes back with a tool result
    again = llm.generate([follow_up], pin, use_tqdm=False)[0]
    assert again.num_cached_tokens == 160
    oracle = llm_nocache.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == oracle.outputs[0].token_ids
    m = llm.get_metrics()
    assert m["kv_pinned_blocks"] == m["kv_pins_taken"] == 10 and m["kv_pins_evicted"] == 0
    assert m["num_blocks_free"] == 20


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_pin_fraction_outside_0_1_is_refused(fraction):
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="kv_pin_fraction"):
        EngineConfig(kv_pin_fraction=fraction).validate()


def test_pin_fraction_zero_turns_pins_off():
    m, _ = make(pin_fraction=0.0)
    run(m, "a", prompt(1), KVRetention(priority=100))
    assert m.pool.num_pinned == 0 and m.pool.pin_counts["refused"] == 3
    flood(m, 6)
    assert run(m, "a2", prompt(1)) == 0 and all_free(m)
