"""Prefix-aware routing: the index built from a real engine's KV events, replay on gaps, policies."""

from __future__ import annotations

import socket
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.distributed.router import (
    PENDING_S,
    EventFeed,
    PrefixIndex,
    PromptHasher,
    ReplayClient,
    ReplicaLoad,
    Router,
    hit_groups,
)
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

ONE = SamplingParams(max_tokens=1, temperature=0)
IDLE = {"a": ReplicaLoad(), "b": ReplicaLoad()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(start: int, n: int) -> list[int]:
    return [1000 + (start + 7 * i) % 5000 for i in range(n)]


@pytest.fixture(scope="module")
def replica_a():
    """One small engine publishing KV events (replica "a"), its replay client and an index fed by it."""
    port, replay_port = _free_port(), _free_port()
    llm = LLM(kv_cache_memory="32MiB", max_model_len=512, dtype="float32",
              kv_events=f"tcp://127.0.0.1:{port}", kv_events_replay=f"tcp://127.0.0.1:{replay_port}")
    replay = ReplayClient(f"tcp://127.0.0.1:{replay_port}")
    index = PrefixIndex(replay=lambda name, start: replay.fetch(start))
    feed = EventFeed(index, "a", f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the subscription reaches the PUB socket before anything is published
    yield llm, index, feed, replay
    feed.close()
    llm.close()


def _sync(llm, index: PrefixIndex, feed: EventFeed, timeout: float = 10.0) -> None:
    """Feed until the index has every batch the engine published."""
    deadline = time.monotonic() + timeout
    while index.replicas.get("a") is None or index.replicas["a"].next_seq < llm.engine.kv_events.seq:
        assert time.monotonic() < deadline, "published batches did not arrive"
        feed.poll(0.1)


def _cached(kv) -> set[bytes]:
    """The engine's cached block hashes (one KV group: the pool keys are the chained hashes)."""
    return set(kv.pool.cached)


def _stored(hasher: PromptHasher, ids: list[int], group: int = 0) -> BlockStored:
    hashes = hasher.block_hashes(ids)
    return BlockStored(hashes, None, ids[:len(hashes) * hasher.block_size], hasher.block_size, group=group)


def test_index_matches_the_engines_cached_blocks(replica_a):
    llm, index, feed, _ = replica_a
    kv = llm.engine.kv
    assert len(kv.groups) == 1
    for start in (0, 500, 900):
        llm.generate({"prompt_token_ids": _prompt(start, 100)}, ONE, use_tqdm=False)
    _sync(llm, index, feed)
    assert index.holds("a") == _cached(kv) and len(_cached(kv)) >= 3 * (100 // kv.block_size)
    hasher = PromptHasher.from_kv(kv)
    ids = _prompt(0, 100)
    assert index.prefix_blocks("a", hasher.block_hashes(ids)) == (100 - 1) // kv.block_size


def test_index_follows_removals_as_the_pool_reuses_blocks(replica_a):
    llm, index, feed, _ = replica_a
    kv = llm.engine.kv
    first = set(index.holds("a"))
    i = 1
    while first & _cached(kv):  # new prompts until the LRU reused every earlier block
        assert i < 30, "the pool never reused the earlier blocks"
        llm.generate({"prompt_token_ids": _prompt(2000 + 300 * i, 200)}, ONE, use_tqdm=False)
        i += 1
    _sync(llm, index, feed)
    assert not first & index.holds("a")
    assert index.holds("a") == _cached(kv)


def test_prefix_policy_routes_a_shared_prefix_to_the_replica_holding_it(replica_a):
    llm, index, feed, _ = replica_a
    kv = llm.engine.kv
    hasher = PromptHasher.from_kv(kv)
    system_a, system_b = _prompt(4000, 96), _prompt(4500, 96)
    llm.generate({"prompt_token_ids": system_a + _prompt(1, 20)}, ONE, use_tqdm=False)
    _sync(llm, index, feed)
    index.apply_events("b", [_stored(hasher, system_b + _prompt(2, 20)).wire()])  # replica "b" by hand
    router = Router("prefix", index, hasher)

    question = system_a + _prompt(3, 30)
    assert router.hit_tokens(["a", "b"], question) == {"a": 96, "b": 0}
    assert router.pick(question, IDLE) == "a"
    assert router.pick(question, {"a": ReplicaLoad(queue_depth=0, kv_usage=0.3), "b": ReplicaLoad()}) == "a"
    out = llm.generate({"prompt_token_ids": question}, ONE, use_tqdm=False)[0]
    assert out.num_cached_tokens == 96  # the engine hit exactly what the router counted
    assert router.pick(system_b + _prompt(4, 30), IDLE) == "b"
    # a replica too busy loses the prefix to an idle one
    assert router.pick(question, {"a": ReplicaLoad(queue_depth=2), "b": ReplicaLoad()}) == "b"
    # no replica holds anything of the prompt: the least loaded one
    assert router.pick(_prompt(4900, 80), {"a": ReplicaLoad(1), "b": ReplicaLoad(0, 0.5)}) == "b"
    # a salted prompt hashes apart: no hit
    assert router.hit_tokens(["a"], question, salt="tenant-1") == {"a": 0}
    _sync(llm, index, feed)


def test_a_gap_is_filled_from_the_engines_replay_socket(replica_a):
    llm, index, feed, replay = replica_a
    _sync(llm, index, feed)
    batches = replay.fetch(0)
    assert [seq for seq, _ in batches] == list(range(len(batches))) and len(batches) >= 4
    late = PrefixIndex(replay=lambda name, start: replay.fetch(start))
    late.feed("a", *batches[0])
    late.feed("a", *batches[-1])  # everything in between missed: asked for by sequence number
    assert late.replicas["a"].next_seq == len(batches) and late.replicas["a"].lost_batches == 0
    assert late.holds("a") == index.holds("a") == _cached(llm.engine.kv)
    late.feed("a", *batches[1])  # a batch seen again changes nothing
    assert late.holds("a") == index.holds("a")


def test_reset_prefix_cache_clears_the_replica(replica_a):
    llm, index, feed, _ = replica_a
    assert index.holds("a")
    llm.reset_prefix_cache()
    _sync(llm, index, feed)
    assert index.holds("a") == set() == _cached(llm.engine.kv)


# ---- hand-built events --------------------------------------------------------------------

HASHER = PromptHasher(b"ns" * 16, 4)


def _batch(*events) -> bytes:
    return encode_batch(time.time(), list(events))


def test_removed_and_cleared_per_kv_group():
    index = PrefixIndex()
    ids = list(range(100, 117))  # 4 usable blocks of 4
    hashes = HASHER.block_hashes(ids)
    index.feed("b", 0, _batch(_stored(HASHER, ids, group=0), _stored(HASHER, ids, group=1)))
    assert index.holds("b", 0) == index.holds("b", 1) == set(hashes)
    index.feed("b", 1, _batch(BlockRemoved(hashes[2:], group=0)))
    assert index.holds("b", 0) == set(hashes[:2]) and index.holds("b", 1) == set(hashes)
    assert index.prefix_blocks("b", hashes, groups=(0, 1)) == 2
    assert index.prefix_blocks("b", hashes, groups=(1,)) == 4
    index.feed("b", 2, _batch(AllBlocksCleared()))
    assert index.holds("b", 0) == index.holds("b", 1) == set()


def test_tier_blocks_count_for_their_replica_and_the_shared_redis_tier_for_none():
    """A replica's CPU/disk tier blocks are its own hits (kept when the device forgets them); blocks
    in the Redis tier every replica reads tell replicas apart for none of them."""
    index = PrefixIndex()
    ids = list(range(200, 217))
    hashes = HASHER.block_hashes(ids)
    cpu = BlockStored(hashes[:3], None, ids[:12], 4, medium="cpu")
    redis = BlockStored(hashes, None, ids[:16], 4, medium="redis")
    index.feed("b", 0, _batch(_stored(HASHER, ids), cpu, redis))
    index.feed("b", 1, _batch(AllBlocksCleared()))             # the device cache only
    assert index.holds("b") == set() and index.prefix_blocks("b", hashes) == 3
    index.feed("b", 2, _batch(BlockRemoved(hashes[1:2], medium="cpu")))
    assert index.prefix_blocks("b", hashes) == 1
    index.feed("c", 0, _batch(BlockStored(hashes, None, ids[:16], 4, medium="redis")))
    assert index.prefix_blocks("c", hashes) == 0
    router = Router("prefix", index, HASHER)
    busier = {"c": ReplicaLoad(), "b": ReplicaLoad(kv_usage=0.01)}   # least-loaded alone would pick c
    assert Router("least-loaded", index, HASHER).pick(ids, busier) == "c"
    assert router.pick(ids, busier) == "b"


def test_a_hit_needs_the_full_attention_groups_only():
    from kvserve.kv.hashing import namespace_hash
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.spec import FullSpec, KVGroup, SlidingWindowSpec

    groups = [KVGroup(SlidingWindowSpec(1, 1, window=8), [0]), KVGroup(FullSpec(1, 1), [1])]
    assert hit_groups(KVCacheManager(9, 4, namespace_hash("g"), groups=groups)) == (1,)
    assert hit_groups(KVCacheManager(9, 4, namespace_hash("g"))) == (0,)


def test_vllm_events_without_a_group_count_as_group_zero():
    index = PrefixIndex()
    hashes = HASHER.block_hashes(list(range(9)))
    index.apply_events("v", [["BlockStored", hashes, None, list(range(8)), 4, None, "device"]])
    assert index.holds("v") == set(hashes)
    index.apply_events("v", [["BlockRemoved", hashes[:1], "device"]])
    assert index.holds("v") == set(hashes[1:])


def test_gap_replayed_and_what_the_replay_lost_is_counted():
    ids = list(range(50, 67))
    h = HASHER.block_hashes(ids)
    published = [_batch(BlockStored(h[:1], None, ids[:4], 4)), _batch(BlockStored(h[1:2], h[0], ids[4:8], 4)),
                 _batch(BlockStored(h[2:3], h[1], ids[8:12], 4)), _batch(BlockRemoved(h[:1]))]
    asked = []

    def replay(name, start):
        asked.append((name, start))
        return list(enumerate(published))[start:]

    index = PrefixIndex(replay=replay)
    index.feed("b", 0, published[0])
    index.feed("b", 3, published[3])
    assert asked == [("b", 1)] and index.holds("b") == set(h[1:3])
    assert index.replicas["b"].lost_batches == 0

    lossy = PrefixIndex(replay=lambda name, start: [(2, published[2])])  # batch 1 fell out of the buffer
    lossy.feed("b", 0, published[0])
    lossy.feed("b", 3, published[3])
    assert lossy.replicas["b"].lost_batches == 1 and lossy.holds("b") == {h[2]}
    blind = PrefixIndex()  # no replay socket at all
    blind.feed("b", 5, published[0])
    assert blind.replicas["b"].lost_batches == 5 and blind.replicas["b"].next_seq == 6


def test_a_restarted_replica_starts_afresh():
    ids = list(range(400, 413))
    h = HASHER.block_hashes(ids)
    index = PrefixIndex()
    index.feed("b", 0, _batch(_stored(HASHER, ids)))
    index.feed("b", 1, _batch(BlockRemoved(h[:1])))
    assert index.holds("b") == set(h[1:])
    index.feed("b", 0, _batch(BlockStored(h[:1], None, ids[:4], 4)))  # a new process numbers from 0
    assert index.holds("b") == {h[0]} and index.replicas["b"].next_seq == 1


def test_drop_replica_forgets_its_blocks_and_routing_moves_on():
    ids = list(range(300, 341))
    index = PrefixIndex()
    index.apply_events("a", [_stored(HASHER, ids).wire()])
    router = Router("prefix", index, HASHER)
    assert router.pick(ids, IDLE) == "a" and router.pick(ids, IDLE) == "a"
    router.drop_replica("a")
    assert index.holds("a") == set() and "a" not in index.replicas
    assert router.pick(ids, {"b": ReplicaLoad(), "c": ReplicaLoad(3)}) == "b"


def test_a_prompt_just_routed_draws_its_followers_until_events_can_confirm_it():
    """Before a replica publishes a prompt's blocks (its prefill is still running), requests sharing
    that prompt follow it to the same replica; PENDING_S later, without events, they do not."""
    now = [0.0]
    router = Router("prefix", PrefixIndex(), HASHER, clock=lambda: now[0])
    system = list(range(500, 580))
    first = router.pick(system + [1, 2, 3], IDLE)
    assert [router.pick(system + [9, i], IDLE) for i in range(4)] == [first] * 4
    assert router.hit_tokens(["a", "b"], system + [7])[first] == len(system) // HASHER.block_size * HASHER.block_size
    now[0] += PENDING_S + 1
    assert router.hit_tokens(["a", "b"], system + [7]) == {"a": 0, "b": 0}
    router.drop_replica(first)
    assert first not in router.pending


def test_round_robin_and_least_loaded():
    rr = Router("round-robin")
    loads = {"a": ReplicaLoad(5), "b": ReplicaLoad(0), "c": ReplicaLoad(1)}
    assert [rr.pick([1, 2, 3], loads) for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("least-loaded")
    assert ll.pick([1], loads) == "b"
    assert ll.pick([1], {"a": ReplicaLoad(1, 0.2), "b": ReplicaLoad(1, 0.1)}) == "b"
    picks = {ll.pick([1], IDLE) for _ in range(4)}  # equal loads: taken in turn
    assert picks == {"a", "b"}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        Router("random")
    with pytest.raises(ValueError, match="PromptHasher"):
        Router("prefix")
    with pytest.raises(ValueError, match="no replica"):
        Router("least-loaded").pick([1], {})


def test_prompt_hashes_skip_the_last_token_as_the_engine_does():
    assert len(HASHER.block_hashes(list(range(8)))) == 1   # 8 tokens: the second block holds the last
    assert len(HASHER.block_hashes(list(range(9)))) == 2
    assert HASHER.block_hashes([1]) == []
