"""KV events over ZeroMQ: BlockStored / BlockRemoved / AllBlocksCleared batches, sequence numbers, replay."""

from __future__ import annotations

import socket
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.options import engine_options
from kvserve.kv.events import END_SEQ, KVEventPublisher, decode_batch
from kvserve.kv.hashing import hash_full_blocks

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

ONE = SamplingParams(max_tokens=1, temperature=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A SUB socket that keeps every (topic, seq, payload) it received, in order."""

    def __init__(self, ctx, endpoint: str, publisher: KVEventPublisher):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.publisher = publisher
        self.batches: list[tuple[bytes, int, bytes]] = []

    def drain(self, timeout: float = 10.0) -> list[tuple[int, float, list]]:
        """Receive until every batch published so far arrived; the new ones as (seq, ts, events)."""
        last = self.publisher.seq - 1
        new = []
        deadline = time.monotonic() + timeout
        while (not self.batches or self.batches[-1][1] < last) and time.monotonic() < deadline:
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                self.batches.append((topic, int.from_bytes(seq, "big"), payload))
                new.append(self.batches[-1])
        assert not last >= 0 or self.batches[-1][1] == last, "published batches did not arrive"
        return [(seq, *decode_batch(payload)) for _, seq, payload in new]


@pytest.fixture(scope="module")
def setup():
    port, replay_port = _free_port(), _free_port()
    llm = LLM(kv_cache_memory="32MiB", max_model_len=512, dtype="float32",
              kv_events=f"tcp://127.0.0.1:{port}", kv_events_replay=f"tcp://127.0.0.1:{replay_port}")
    ctx = zmq.Context()
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}", llm.engine.kv_events)
    time.sleep(0.3)  # the subscription reaches the PUB socket before anything is published
    yield llm, sub, ctx, f"tcp://127.0.0.1:{replay_port}"
    sub.sock.close()
    llm.close()
    ctx.term()


def _events(batches, kind: str) -> list[list]:
    return [e for _, _, events in batches for e in events if e[0] == kind]


def _prompt(start: int, n: int) -> list[int]:
    return [1000 + (start + 7 * i) % 5000 for i in range(n)]


def test_stored_events_are_the_engines_cached_blocks_chained_by_parent(setup):
    llm, sub, _, _ = setup
    kv = llm.engine.kv
    ids = _prompt(0, 100)
    llm.generate({"prompt_token_ids": ids}, ONE, use_tqdm=False)
    stored = _events(sub.drain(), "BlockStored")
    bs = kv.block_size
    expected = hash_full_blocks(kv.namespace, ids, bs, algo=kv.hash_algo)  # 6 full blocks of the prompt
    assert len(expected) == 100 // bs and all(h in kv.pool.cached for h in expected)
    hashes = [h for e in stored for h in e[1]]
    assert hashes == expected
    parent = None
    for _, block_hashes, parent_hash, token_ids, block_size, lora_id, medium, group in stored:
        assert parent_hash == parent  # each event continues the chain of the one before
        assert block_size == bs and len(token_ids) == bs * len(block_hashes) and lora_id is None
        assert (medium, group) == ("device", 0)
        parent = block_hashes[-1]
    assert [t for e in stored for t in e[3]] == ids[:len(expected) * bs]


def test_reusing_cached_blocks_emits_block_removed(setup):
    llm, sub, _, _ = setup
    kv = llm.engine.kv
    first = _prompt(0, 100)
    first_hashes = hash_full_blocks(kv.namespace, first, kv.block_size, algo=kv.hash_algo)
    stored, removed = set(first_hashes), []
    i = 1
    while not set(first_hashes) <= set(removed):  # new prompts until the LRU reuses the first one's blocks
        assert i < 20, "the pool never reused the first prompt's blocks"
        llm.generate({"prompt_token_ids": _prompt(1000 * i, 200)}, ONE, use_tqdm=False)
        batches = sub.drain()
        stored |= {h for e in _events(batches, "BlockStored") for h in e[1]}
        for e in _events(batches, "BlockRemoved"):
            assert (e[2], e[3]) == ("device", 0)
            removed += e[1]
        i += 1
    assert len(removed) == len(set(removed)) and set(removed) <= stored  # each removed once, after being stored
    assert not set(removed) & set(kv.pool.cached)
    cached = stored - set(removed)
    assert cached == set(kv.pool.cached)  # the events tell exactly what the engine holds


def test_reset_prefix_cache_emits_all_blocks_cleared(setup):
    llm, sub, _, _ = setup
    assert llm.engine.kv.pool.num_cached > 0
    llm.reset_prefix_cache()
    batches = sub.drain()
    assert [e for _, _, events in batches for e in events] == [["AllBlocksCleared"]]
    assert llm.engine.kv.pool.num_cached == 0


def test_sequence_numbers_have_no_gaps_and_one_topic(setup):
    _, sub, _, _ = setup
    assert [seq for _, seq, _ in sub.batches] == list(range(len(sub.batches)))
    assert {topic for topic, _, _ in sub.batches} == {b"kv-events"}
    stamps = [decode_batch(p)[0] for _, _, p in sub.batches]
    assert stamps == sorted(stamps) and abs(stamps[-1] - time.time()) < 600


def _replay(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()


def test_replay_returns_the_batches_a_late_subscriber_missed(setup):
    llm, sub, ctx, replay_endpoint = setup
    llm.generate({"prompt_token_ids": _prompt(77, 40)}, ONE, use_tqdm=False)
    sub.drain()
    seen = [(seq, payload) for _, seq, payload in sub.batches]
    assert len(seen) >= 3
    assert _replay(ctx, replay_endpoint, 0) == seen
    assert _replay(ctx, replay_endpoint, 2) == seen[2:]
    assert _replay(ctx, replay_endpoint, len(seen)) == []


def test_bad_endpoints_fail_at_start_up_with_a_clear_error():
    with pytest.raises(ValueError, match="kv_events must be a ZeroMQ endpoint"):
        engine_options(EngineConfig(kv_events="127.0.0.1:5557"))
    with pytest.raises(ValueError, match="kv_events_replay must be a ZeroMQ endpoint"):
        engine_options(EngineConfig(kv_events="tcp://127.0.0.1:5557", kv_events_replay="http://x"))
    with pytest.raises(ValueError, match="give kv_events too"):
        EngineConfig(kv_events_replay="tcp://127.0.0.1:5558").validate()
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_events="tcp://127.0.0.1:5557", enable_prefix_caching=False).validate()
    with pytest.raises(ValueError, match="kv_events must be a ZeroMQ endpoint"):
        LLM(kv_events="localhost")
    port = _free_port()
    first = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match="kv_events: cannot bind"):
            KVEventPublisher(f"tcp://127.0.0.1:{port}")
    finally:
        first.close()
    assert EngineConfig().kv_events is None  # off by default


def test_events_bind_only_loopback_unless_allowed():
    """Events carry every prompt's token ids and ZeroMQ has no authentication."""
    for remote in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://[::]:5557", "tcp://eth0:5557"):
        with pytest.raises(ValueError, match="--kv-events-allow-remote"):
            engine_options(EngineConfig(kv_events=remote))
        engine_options(EngineConfig(kv_events=remote, kv_events_allow_remote=True))
    with pytest.raises(ValueError, match="kv_events_replay: 'tcp://\\*:5558' can be reached"):
        engine_options(EngineConfig(kv_events="tcp://127.0.0.1:5557", kv_events_replay="tcp://*:5558"))
    for local in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", "ipc:///tmp/kv-events"):
        engine_options(EngineConfig(kv_events=local))


def test_manager_reports_each_kv_group_under_the_chain_hash():
    """Two KV groups (full + sliding): the same chained hashes, told apart by `group`, stored and removed."""
    from kvserve.kv.events import KVEventQueue
    from kvserve.kv.hashing import namespace_hash
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.spec import FullSpec, KVGroup, SlidingWindowSpec

    groups = [KVGroup(FullSpec(1, 1), [0]), KVGroup(SlidingWindowSpec(1, 1, window=64), [1])]
    ns = namespace_hash("events-test")
    kv = KVCacheManager(9, 4, ns, groups=groups, events=KVEventQueue())
    ids = list(range(100, 112))  # 3 full blocks of 4
    assert kv.allocate_slots("a", 0, len(ids))
    kv.cache_blocks("a", ids, len(ids))
    chain = hash_full_blocks(ns, ids, 4)
    stored = kv.events.take()
    assert [(e.group, e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
        (0, chain, None, ids), (1, chain, None, ids)]
    kv.free("a")
    assert kv.allocate_slots("b", 0, 16)  # 4 blocks per group: every usable block, the cached ones reused
    removed = kv.events.take()
    assert sorted((e.group, h) for e in removed for h in e.block_hashes) == sorted(
        (g, h) for g in (0, 1) for h in chain)
    assert all(e.medium == "device" for e in removed)


def test_blocks_loaded_back_from_a_tier_are_reported_stored_on_the_device():
    from kvserve.kv.events import KVEventQueue
    from kvserve.kv.hashing import namespace_hash
    from kvserve.kv.manager import KVCacheManager

    class EveryBlockInCpuTier:
        def locate(self, hashes):
            return ["cpu"] * len(hashes)

        def load(self, items, pending_copies=None):
            return ["cpu"] * len(items)

    ns = namespace_hash("events-tier-test")
    kv = KVCacheManager(8, 4, ns, lower=EveryBlockInCpuTier(), events=KVEventQueue())
    ids = list(range(200, 213))  # 3 full blocks before the last token
    hits, n = kv.get_computed_blocks("r", ids)
    assert n == 12
    chain = hash_full_blocks(ns, ids, 4)
    stored = kv.events.take()
    assert [(e.block_hashes, e.parent_block_hash, e.medium) for e in stored] == [
        ([chain[0]], None, "device"), ([chain[1]], chain[0], "device"), ([chain[2]], chain[1], "device")]
    assert [kv.pool.cached[h] for h in chain] == hits[0]


def test_tier_events_name_their_medium():
    """A write-through CPU tier reports each block it stores (medium 'cpu', the device's hashes and
    group) and each block its size bound pushes out, the least recently stored first."""
    port = _free_port()
    llm = LLM(kv_cache_memory="32MiB", max_model_len=512, dtype="float32", kv_tiers=["cpu:2MiB:write_through"],
              kv_events=f"tcp://127.0.0.1:{port}")
    ctx = zmq.Context()
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}", llm.engine.kv_events)
    try:
        time.sleep(0.3)
        llm.generate({"prompt_token_ids": _prompt(3, 100)}, ONE, use_tqdm=False)
        assert llm.engine.tiers.flush(30)
        llm.engine.kv_events.flush()          # what the writer thread recorded after the last step
        batches = sub.drain()
        device = [h for e in _events(batches, "BlockStored") if e[6] == "device" for h in e[1]]
        cpu = [e for e in _events(batches, "BlockStored") if e[6] == "cpu"]
        assert len(device) == 6 and [h for e in cpu for h in e[1]] == device   # 100 tokens: 6 full blocks
        assert all(e[7] == 0 and len(e[3]) == e[4] == 16 for e in cpu)
        removed = [h for e in _events(batches, "BlockRemoved") if e[2] == "cpu" for h in e[1]]
        tier = llm.engine.tiers.tiers[0]
        kept = [device.index(bytes.fromhex(k.rsplit("/", 1)[1])) for k in tier.entries]
        assert 0 < len(kept) < 6 and removed == device[:6 - len(kept)]          # LRU: the oldest went first
        assert kept == list(range(6 - len(kept), 6))
    finally:
        sub.sock.close()
        llm.close()
        ctx.term()
