"""KV tiers: entries, checksums and MACs, each tier's LRU bound, the bridge under the manager, write
policies (write-through off the step loop, write-back on eviction), and engines sharing a disk or
Redis tier across processes, with faults (corrupt, forged and poisoned entries, an unwritable
directory, Redis down or hung)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import all_blocks_free, poison_entry, tier_keys

from kvserve import LLM, SamplingParams
from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager, new_pool
from kvserve.kv.spec import FullSpec, KVGroup, SlidingWindowSpec
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers import (
    CRC,
    CorruptEntry,
    CpuTier,
    DiskTier,
    HmacSeal,
    RedisTier,
    RefusedEntry,
    TierBridge,
    TierSpec,
    TierStats,
    make_tier,
    pack_entry,
    pack_rows,
    tier_namespace,
    unpack_entry,
    unpack_rows,
)

WORKER = Path(__file__).with_name("tier_worker.py")
LAYOUT = [(torch.float32, (4, 2, 3)), (torch.bfloat16, (4, 2, 3)), (torch.float8_e4m3fn, (4, 5))]
KEY = bytes(range(16))
TOKENS = (1, 2, 3, 4)
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def block(seed: int) -> list[torch.Tensor]:
    """One block's tensors for LAYOUT, as [1, ...] rows."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((1, *shape), generator=g).to(dtype) for dtype, shape in LAYOUT]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b))


def entry(seed: int = 0, key: bytes = KEY, tokens=TOKENS) -> bytes:
    return pack_entry(key, tokens, LAYOUT, pack_rows(block(seed))[0])


# ---- entries ---------------------------------------------------------------------------------
def test_entry_roundtrip_is_bit_exact():
    data = entry(3)
    row = unpack_entry(data, KEY, TOKENS, LAYOUT)
    assert same_bits(unpack_rows(row[None], LAYOUT), block(3))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "append"])
def test_damaged_entry_is_detected(damage):
    data = bytearray(entry())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"\0"
    with pytest.raises(CorruptEntry):
        unpack_entry(bytes(data), KEY, TOKENS, LAYOUT)


def test_entry_for_another_block_or_layout_is_refused():
    data = entry()
    with pytest.raises(CorruptEntry):
        unpack_entry(data, bytes(16), TOKENS, LAYOUT)            # another key
    with pytest.raises(CorruptEntry):
        unpack_entry(data, KEY, (1, 2, 3, 5), LAYOUT)            # a hash collision: other tokens
    with pytest.raises(CorruptEntry):
        unpack_entry(data, KEY, TOKENS, LAYOUT[:2] + [(torch.int8, (4, 5))])  # another format


KEY_A, KEY_B = b"a" * 32, b"b" * 32


def test_signed_entries_open_only_under_their_key_and_namespace():
    seal = HmacSeal(KEY_A, "ns")
    data = pack_entry(KEY, TOKENS, LAYOUT, pack_rows(block(3))[0], seal)
    assert data[:4] == b"KVH1" and data[:4] != entry()[:4]
    assert same_bits(unpack_rows(unpack_entry(data, KEY, TOKENS, LAYOUT, seal)[None], LAYOUT), block(3))
    for reader in (HmacSeal(KEY_B, "ns"), HmacSeal(KEY_A, "other-namespace")):
        with pytest.raises(RefusedEntry, match="MAC does not match") as refused:
            unpack_entry(data, KEY, TOKENS, LAYOUT, reader)
        assert not refused.value.keep                         # deleted: the reader writes its own
    tampered = bytearray(data)
    tampered[len(data) // 2] ^= 0x01
    with pytest.raises(RefusedEntry, match="MAC"):
        unpack_entry(bytes(tampered), KEY, TOKENS, LAYOUT, seal)
    with pytest.raises(RefusedEntry, match="not signed") as refused:   # a keyless writer's entry
        unpack_entry(entry(), KEY, TOKENS, LAYOUT, seal)
    assert not refused.value.keep
    with pytest.raises(RefusedEntry, match="has none") as refused:     # a keyless reader
        unpack_entry(data, KEY, TOKENS, LAYOUT, CRC)
    assert refused.value.keep                                 # kept: valid for the key's holders
    assert "key" not in repr(seal).replace("<key>", "") and KEY_A.decode() not in repr(seal)


def test_namespace_names_what_makes_caches_incompatible():
    base = dict(weights="abc", dtype=torch.float32, kv_format="auto", block_size=16,
                layer_specs="full x30", layout=LAYOUT)
    ns = tier_namespace(**base)
    assert tier_namespace(**base) == ns
    for change in (dict(weights="abd"), dict(dtype=torch.bfloat16), dict(kv_format="int8"),
                   dict(block_size=32), dict(layer_specs="full x29"), dict(layout=LAYOUT[:2])):
        assert tier_namespace(**{**base, **change}) != ns, change


# ---- each tier's bound -----------------------------------------------------------------------
def test_cpu_tier_lru_bound():
    size = len(entry())
    tier = CpuTier(capacity=3 * size)
    tier.put_many([(f"ns/{i}", entry(i)) for i in range(3)])
    assert tier.get("ns/0") is not None                         # 0 becomes the most recent
    tier.put_many([("ns/3", entry(3))])
    assert tier.contains(["ns/0", "ns/1", "ns/2", "ns/3"]) == [True, False, True, True]
    assert tier.usage_bytes == 3 * size <= tier.capacity and tier.stats.evictions == 1
    tier.put_many([("ns/big", b"x" * (4 * size))])              # larger than the whole tier: skipped
    assert tier.contains(["ns/big"]) == [False]


def test_disk_tier_lru_bound_and_restart(tmp_path):
    size = len(entry())
    tier = DiskTier(tmp_path, capacity=3 * size)
    for i in range(3):
        tier.put_many([(f"ns/{i:02x}", entry(i))])
        time.sleep(0.01)  # distinct mtimes
    assert tier.get("ns/00") == entry(0)                         # touched: most recent
    time.sleep(0.01)
    tier.put_many([("ns/03", entry(3))])
    assert tier.contains(["ns/00", "ns/01", "ns/02", "ns/03"]) == [True, False, True, True]
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["00.kvb", "02.kvb", "03.kvb"]               # no temporary files left behind
    # a new process (here: a new tier) sees the entries and their LRU order from the files' mtimes
    again = DiskTier(tmp_path, capacity=2 * size)
    assert again.usage_bytes == 2 * size
    assert again.contains(["ns/00", "ns/02", "ns/03"]) == [True, False, True]
    assert again.get("ns/03") == entry(3)


def test_redis_tier_bound_is_redis_lru(make_redis):
    server = make_redis("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    tier = RedisTier(server.url)
    big = b"x" * 200_000
    for i in range(60):                                           # 12 MB into a 4 MB server
        tier.put_many([(f"ns/{i}", big)])
    present = tier.contains([f"ns/{i}" for i in range(60)])
    assert present[-1] and sum(present) < 25 and not present[0]
    assert tier.stats.errors == 0


def test_a_full_redis_that_refuses_writes_is_logged_once_and_counted(make_redis, caplog):
    """maxmemory with noeviction: every SET past the bound is refused (OOM). One warning, every
    entry not stored counted in write_errors, and lookups keep working."""
    server = make_redis("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    tier = RedisTier(server.url)
    big = b"x" * 200_000
    with caplog.at_level("WARNING", logger="kvserve"):
        for i in range(30):                                       # 6 MB into a 2 MB server
            tier.put_many([(f"ns/{i}", big), (f"ns/{i}b", big)])
    stored = sum(tier.contains([f"ns/{i}{s}" for i in range(30) for s in ("", "b")]))
    assert 0 < stored < 60
    assert tier.stats.write_errors == 60 - stored
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    assert tier.get("ns/0") == big


# ---- the bridge: save on eviction, load on a device miss, never serve a bad entry ------------
def tiered_cache(tiers, num_blocks=8, block_size=4, groups=None, queue_blocks=None):
    """A KV manager and storage over one pool, with a bridge to `tiers` below (built as the engine's
    builder does: pool, storage, bridge, manager); `queue_blocks` bounds each writer's queue."""
    groups = groups or [KVGroup(FullSpec(num_kv_heads=2, head_dim=3), [0, 1])]
    pool = new_pool(num_blocks, groups)
    storage = KVStorage(groups, num_blocks, block_size, torch.float32, block_is_free=pool.is_free)
    options = {"queue_bytes": queue_blocks * storage.bytes_per_block} if queue_blocks else {}
    bridge = TierBridge(tiers, storage, "ns", pool, **options) if tiers else None
    kv = KVCacheManager(num_blocks, block_size, namespace_hash("unit", "tiers"), groups=groups, pool=pool,
                        listeners=[bridge] if bridge else [], lower=bridge)
    return kv, storage, bridge


def fill(storage: KVStorage, blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn((len(blocks), *shape), generator=g).to(dtype) for dtype, shape in storage.block_layout()]
    storage.write_blocks(blocks, tensors)


def run_request(kv: KVCacheManager, storage: KVStorage, rid: str, tokens: list[int], seed: int):
    """Admit a request, 'compute' its blocks (random data), register them, free it; hits and blocks."""
    hits, num_hit = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, num_hit, len(tokens) - num_hit, hits)
    kv.record_prefix_query(len(tokens), num_hit, hits)
    tables = [list(kv.block_ids(rid, g)) for g in range(len(kv.groups))]
    new = [b for t, h in zip(tables, hits) for b in t[len(h):] if b != kv.null]
    fill(storage, new, seed)
    kv.cache_blocks(rid, tokens, len(tokens))
    contents = {b: [t[b].clone() for t in storage.block_tensors()] for t in tables for b in t if b != kv.null}
    kv.free(rid)
    return num_hit, tables, contents


def test_evicted_blocks_come_back_from_the_tier_bit_exact():
    tier = CpuTier(1 << 20)
    kv, storage, _ = tiered_cache([tier])
    prompt = list(range(100, 117))                        # 4 full blocks + 1 token
    _, tables, contents = run_request(kv, storage, "a", prompt, seed=1)
    run_request(kv, storage, "b", list(range(500, 532)), seed=2)  # 8 blocks: evicts all of a's
    assert tier.stats.entries_written == 4
    num_hit, new_tables, _ = run_request(kv, storage, "c", prompt, seed=3)
    assert num_hit == 16 and tier.stats.hits == 4
    assert kv.stats.hits_by_source == {"device": 0, "cpu": 16}
    for old, new in zip(tables[0][:4], new_tables[0][:4]):
        assert same_bits([t[new] for t in storage.block_tensors()], contents[old])
    # loaded blocks are registered: the next request finds them on the device
    assert run_request(kv, storage, "d", prompt, seed=4)[0] == 16
    assert kv.stats.hits_by_source == {"device": 16, "cpu": 16}


def test_corrupt_entry_is_dropped_and_the_prefix_stops_there(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, write_policy="write_back")
    kv, storage, bridge = tiered_cache([tier])
    prompt = list(range(100, 117))
    run_request(kv, storage, "a", prompt, seed=1)
    kv.reset_prefix_cache(offload=True)
    third = tier._path(bridge.key(_chain_hash(kv, prompt, 2)))
    data = bytearray(third.read_bytes())
    data[-50] ^= 0xFF
    third.write_bytes(bytes(data))
    num_hit, _, _ = run_request(kv, storage, "c", prompt, seed=3)
    assert num_hit == 8                                   # blocks 0 and 1; block 2 was corrupt
    assert tier.stats.corrupt == 1 and tier.stats.errors == 1 and not third.exists()


def _chain_hash(kv: KVCacheManager, tokens: list[int], index: int) -> bytes:
    from kvserve.kv.hashing import hash_full_blocks
    return hash_full_blocks(kv.namespace, tokens, kv.block_size)[index]


def test_hybrid_groups_load_only_the_window_of_sliding_layers():
    full = KVGroup(FullSpec(num_kv_heads=2, head_dim=3), [0])
    sliding = KVGroup(SlidingWindowSpec(num_kv_heads=2, head_dim=3, window=6), [1])
    tier = CpuTier(1 << 20)
    kv, storage, _ = tiered_cache([tier], num_blocks=24, groups=[full, sliding])
    prompt = list(range(100, 121))                        # 5 full blocks + 1 token
    run_request(kv, storage, "a", prompt, seed=1)
    kv.reset_prefix_cache(offload=True)
    written = tier.stats.entries_written
    num_hit, tables, _ = run_request(kv, storage, "c", prompt, seed=3)
    assert num_hit == 20
    assert all(b != kv.null for b in tables[0][:5])       # every full-attention block came back
    assert tables[1][:3] == [kv.null] * 3                 # only the window of the sliding group
    assert tier.stats.hits == 5 + 2 and written >= 5 + 2


# ---- write policies --------------------------------------------------------------------------
def test_write_through_stores_blocks_when_registered_write_back_on_eviction(tmp_path):
    back, through = CpuTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    assert (back.write_policy, through.write_policy) == ("write_back", "write_through")  # the defaults
    kv, storage, bridge = tiered_cache([back, through])
    prompt = list(range(100, 117))                        # 4 full blocks + 1 token
    _, tables, contents = run_request(kv, storage, "a", prompt, seed=1)
    bridge.write_through()                                # what the engine does after each step
    assert bridge.flush(timeout=10)
    assert through.stats.entries_written == 4 and back.stats.entries_written == 0
    for i, block_id in enumerate(tables[0][:4]):          # each entry holds its block's bytes
        h = _chain_hash(kv, prompt, i)
        row = unpack_entry(through.get(bridge.key(h)), h, tuple(prompt[4 * i:4 * i + 4]), bridge.layout)
        assert same_bits(unpack_rows(row[None], bridge.layout), [t[None] for t in contents[block_id]])
    run_request(kv, storage, "b", list(range(500, 532)), seed=2)  # 8 blocks: evicts all of a's
    bridge.write_through()
    assert bridge.flush(timeout=10)
    assert back.stats.entries_written == 4                # write_back: when the device evicts them
    assert through.stats.entries_written == 4 + 8         # b's blocks; a's were not written again


class SlowTier:
    """A write-through tier whose stores wait until `gate` opens (`writing` is set while one waits)."""

    name, write_policy, usage_bytes = "slow", "write_through", None

    def __init__(self):
        self.stats, self.gate, self.stored = TierStats(), threading.Event(), {}
        self.writing = threading.Event()

    def contains(self, keys):
        return [k in self.stored for k in keys]

    def get(self, key):
        return self.stored.get(key)

    def put_many(self, items):
        self.writing.set()
        self.gate.wait(30)
        self.stored.update(items)
        self.stats.add(entries_written=len(items))

    def delete(self, key):
        self.stored.pop(key, None)


def test_full_write_queue_drops_and_counts_instead_of_blocking():
    tier = SlowTier()
    kv, storage, bridge = tiered_cache([tier], num_blocks=16, queue_blocks=2)
    prompt = list(range(100, 117))                        # 4 full blocks
    run_request(kv, storage, "a", prompt, seed=1)
    t0 = time.perf_counter()
    bridge.write_through()                                # the tier is stuck: 2 blocks fit, 2 dropped
    run_request(kv, storage, "b", list(range(200, 209)), seed=2)
    bridge.write_through()                                # 2 more: the queue is still full
    assert time.perf_counter() - t0 < 1.0                 # the step never waits for the tier
    m = bridge.metrics()["slow"]
    assert m["write_drops"] == 2 + 2 and m["pending_writes"] == 2
    tier.gate.set()
    assert bridge.flush(timeout=10)
    assert set(tier.stored) == {bridge.key(_chain_hash(kv, prompt, i)) for i in range(2)}  # the leading blocks
    m = bridge.metrics()["slow"]
    assert m["pending_writes"] == 0 and m["entries_written"] == 2 and m["flush_seconds"] > 0


def test_a_dropped_prefix_leaves_the_device_every_tier_and_the_write_queues(tmp_path):
    slow, disk, cpu = SlowTier(), DiskTier(tmp_path, 1 << 20), CpuTier(1 << 20, write_policy="write_through")
    kv, storage, bridge = tiered_cache([cpu, disk, slow], num_blocks=16)
    first = list(range(100, 109))                         # 2 full blocks: stored in every tier
    run_request(kv, storage, "a", first, seed=1)
    bridge.write_through()
    slow.gate.set()
    assert bridge.flush(timeout=10)
    slow.gate.clear()
    slow.writing.clear()
    prompt = first + list(range(109, 117))                # its 2 blocks hit, 2 more are computed
    hits, num_hit = kv.get_computed_blocks("b", prompt)
    assert num_hit == 8 and kv.allocate_slots("b", num_hit, len(prompt) - num_hit, hits)
    fill(storage, kv.block_ids("b")[2:], seed=2)
    kv.cache_blocks("b", prompt, len(prompt))
    bridge.write_through()                                # b's 2 new blocks are queued
    assert all(w.flush(10) for w in bridge.writers[:2])   # in the cpu and disk tiers already
    assert slow.writing.wait(10)                          # the slow tier's writer is inside put_many
    keys = [bridge.key(_chain_hash(kv, prompt, i)) for i in range(4)]
    assert kv.drop_prefix("b") == 4                       # b fails: its prefix is not to be trusted
    assert not any(k in kv.pool.cached for k in (_chain_hash(kv, prompt, i) for i in range(4)))
    slow.gate.set()
    assert bridge.flush(timeout=10)
    assert cpu.contains(keys) == disk.contains(keys) == slow.contains(keys) == [False] * 4
    assert not any(tmp_path.rglob("*.kvb"))
    assert [t.stats.poisoned for t in (cpu, disk, slow)] == [4, 4, 4]   # slow: 2 deleted once written
    kv.free("b")
    assert kv.pool.num_free == kv.num_blocks
    assert kv.get_computed_blocks("c", prompt)[1] == 0    # nothing of it is found again


def test_a_dropped_prefix_is_deleted_from_redis(redis_server):
    tier = RedisTier(redis_server.url)
    kv, storage, bridge = tiered_cache([tier])
    prompt = list(range(100, 117))                        # 4 full blocks
    hits, num_hit = kv.get_computed_blocks("a", prompt)
    assert kv.allocate_slots("a", num_hit, len(prompt), hits)
    fill(storage, kv.block_ids("a"), seed=1)
    kv.cache_blocks("a", prompt, len(prompt))
    bridge.write_through()
    assert bridge.flush(timeout=10)
    keys = [bridge.key(_chain_hash(kv, prompt, i)) for i in range(4)]
    assert tier.contains(keys) == [True] * 4
    assert kv.drop_prefix("a") == 4
    assert tier.contains(keys) == [False] * 4 and tier.stats.poisoned == 4
    kv.free("a")
    assert kv.get_computed_blocks("b", prompt)[1] == 0


def test_unwritable_disk_tier_warns_once_and_counts_the_rest(tmp_path, caplog):
    tier = DiskTier(tmp_path, 1 << 20)
    (tmp_path / "ns").write_text("a file where the namespace's directory should be")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        for i in range(3):
            tier.put_many([(f"ns/{i:02x}", entry(i)), (f"ns/1{i:01x}", entry(i))])
    warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "write_errors" in warnings[0]
    assert tier.stats.write_errors == tier.stats.errors == 6 and tier.stats.entries_written == 0
    with pytest.raises(ValueError, match="cannot create the directory"):
        DiskTier(tmp_path / "ns" / "below-a-file", 1 << 20)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_write_through_disk_entries_are_fsynced_with_their_directory(tmp_path, monkeypatch, policy):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    tier = DiskTier(tmp_path, 1 << 20, write_policy=policy)
    tier.put_many([("ns/aa01", entry(0)), ("ns/aa02", entry(1)), ("ns/bb03", entry(2))])
    if policy == "write_through":
        assert sorted(synced) == [False] * 3 + [True] * 2  # each file, then each of its 2 directories once
    else:
        assert synced == []                                # the step thread does not wait for the disk
    assert len(list(tmp_path.rglob("*.kvb"))) == 3


EXIT_WITHOUT_CLOSE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from test_tiers import run_request, tiered_cache
from kvserve.kv.tiers import DiskTier

class SlowDisk(DiskTier):
    def put_many(self, items):
        time.sleep(0.5)
        super().put_many(items)

kv, storage, bridge = tiered_cache([SlowDisk(sys.argv[1], 1 << 20)])
run_request(kv, storage, "a", list(range(100, 117)), seed=1)
bridge.write_through()
print(bridge.writers[0].pending_blocks)   # still queued when the script ends
"""


def test_pending_writes_reach_the_tier_when_a_script_exits_without_close(tmp_path):
    proc = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["4"]
    assert len(list(tmp_path.rglob("*.kvb"))) == 4        # written at interpreter exit


# ---- engines ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_ids(llm):
    from pydoc_data.topics import topics
    return llm.get_tokenizer().encode(topics["assignment"] + topics["compound"])


@pytest.fixture(scope="module")
def doc(corpus_ids):
    """A 401-token document prompt: 25 full blocks, all of them prefix hits when it comes again."""
    return corpus_ids[:401]


@pytest.fixture(scope="module")
def filler(corpus_ids):
    """A prompt that, with 8 new tokens, needs all 32 blocks of a max_model_len=512 pool."""
    return corpus_ids[1000:1490]


@pytest.fixture(scope="module")
def reference(llm, doc):
    """Greedy tokens for `doc` from an engine without tiers."""
    return llm.generate([doc], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


POOL_32 = 32 * 16 * 46080    # exactly one max_model_len=512 sequence of SmolLM2 in float32


def run_worker(engine: dict, prompts: list, offload: bool = False) -> dict:
    job = json.dumps({"engine": engine, "prompts": prompts, "offload": offload})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKER), job], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_tier_serves_blocks_the_device_evicted(doc, filler, reference):
    llm = LLM(kv_cache_memory=POOL_32, max_model_len=512, kv_tiers=["cpu:256MiB"], dtype="float32")
    first = llm.generate([doc], GREEDY, use_tqdm=False)[0]
    assert llm.get_metrics()["kv_tiers"]["cpu"]["entries_written"] == 0  # write_back: nothing before eviction
    llm.generate([filler], GREEDY, use_tqdm=False)         # needs the whole pool: evicts every doc block
    again = llm.generate([doc], GREEDY, use_tqdm=False)[0]
    m = llm.get_metrics()
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 400
    assert m["prefix_cache_hits_by_source"]["cpu"] == again.num_cached_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == reference
    assert m["kv_tiers"]["cpu"]["hits"] == 25 and m["kv_tiers"]["cpu"]["errors"] == 0


def test_disk_tier_across_processes(tmp_path, doc, reference):
    engine = dict(kv_cache_memory=POOL_32, max_model_len=512, kv_tiers=[f"disk:{tmp_path}:1GiB"], dtype="float32")
    a = run_worker(engine, [doc])                         # A computes doc (nothing evicted) and exits
    disk = a["kv_tiers"]["disk"]
    assert a["cached"] == [0] and disk["write_policy"] == "write_through"
    assert disk["entries_written"] == 25 and disk["write_drops"] == 0 and disk["pending_writes"] == 0
    assert disk["bytes_written"] == sum(p.stat().st_size for p in tmp_path.rglob("*.kvb"))
    b = run_worker(engine, [doc])                         # B: a new process, the same directory
    assert b["cached"][0] == 400               # every full block of the prompt from disk
    assert b["hits_by_source"]["disk"] == b["cached"][0]
    assert b["outputs"][0] == a["outputs"][0] == reference


def test_redis_tier_shared_by_two_processes(redis_server, doc, reference):
    engine = dict(kv_cache_memory="64MiB", max_model_len=512, kv_tiers=[redis_server.url], dtype="float32")
    a = run_worker(engine, [doc])                         # A computes doc (nothing evicted) and exits
    b = run_worker(engine, [doc])
    assert a["kv_tiers"]["redis"]["entries_written"] == 25
    assert b["cached"][0] == 400 and b["hits_by_source"]["redis"] == 400
    assert b["kv_tiers"]["redis"]["hits"] == 25 and b["kv_tiers"]["redis"]["errors"] == 0
    assert b["outputs"][0] == a["outputs"][0] == reference


@pytest.mark.parametrize("other", [dict(dtype="bfloat16"), dict(dtype="float32", kv_cache_dtype="int8"),
                                   dict(dtype="float32", weights="int8")], ids=["dtype", "format", "weights"])
def test_other_dtype_or_format_gets_no_hits(tmp_path, doc, other):
    tiers = [f"disk:{tmp_path}:1GiB"]
    writer = LLM(kv_cache_memory="32MiB", max_model_len=512, kv_tiers=tiers, dtype="float32")
    writer.generate([doc[:100]], GREEDY, use_tqdm=False)
    assert writer.reset_prefix_cache(offload=True) == 6
    del writer
    reader = LLM(kv_cache_memory="32MiB", max_model_len=512, kv_tiers=tiers, **other)
    out = reader.generate([doc[:100]], GREEDY, use_tqdm=False)[0]
    m = reader.get_metrics()
    assert out.num_cached_tokens == 0 and m["kv_tiers"]["disk"]["hits"] == 0
    assert m["kv_tiers"]["disk"]["corrupt"] == 0          # never even read: other keys
    # the same engine again (same options) does hit its own entries
    same = LLM(kv_cache_memory="32MiB", max_model_len=512, kv_tiers=tiers, dtype="float32")
    assert same.generate([doc[:100]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 96


def test_corrupt_disk_entries_are_never_served(tmp_path, doc, reference):
    tiers = [f"disk:{tmp_path}:1GiB:write_back"]         # recomputed blocks are not written again
    writer = LLM(kv_cache_memory="64MiB", max_model_len=512, kv_tiers=tiers, dtype="float32")
    writer.generate([doc], GREEDY, use_tqdm=False)
    assert not any(tmp_path.rglob("*.kvb"))               # write_back: nothing before eviction or offload
    writer.reset_prefix_cache(offload=True)
    files = sorted(tmp_path.rglob("*.kvb"), key=lambda p: p.stat().st_size)
    assert len(files) == 25
    damaged = files[:3]
    data = bytearray(damaged[0].read_bytes())
    data[len(data) // 2] ^= 0x01                          # one flipped bit in the payload
    damaged[0].write_bytes(bytes(data))
    damaged[1].write_bytes(damaged[1].read_bytes()[:1000])  # truncated
    damaged[2].write_bytes(b"")                           # empty
    out = writer.generate([doc], GREEDY, use_tqdm=False)[0]
    disk = writer.get_metrics()["kv_tiers"]["disk"]
    assert out.outputs[0].token_ids == reference
    assert disk["corrupt"] == 3 and disk["errors"] == 3   # each read once, dropped
    assert out.num_cached_tokens < 400                    # the prefix stops at the first bad block
    assert not any(p.exists() for p in damaged)


def test_redis_killed_mid_run_then_back(make_redis, doc, filler, reference, caplog):
    server = make_redis()
    llm = LLM(kv_cache_memory=POOL_32, max_model_len=512, kv_tiers=[server.url + ":write_back"], dtype="float32")
    tier = llm.engine.tiers.tiers[0]
    assert llm.generate([doc], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference
    server.stop()                                         # Redis dies
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        for _ in range(2):
            llm.generate([filler], GREEDY, use_tqdm=False)  # evicts doc: writes fail
            out = llm.generate([doc], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference
    m = llm.get_metrics()["kv_tiers"]["redis"]
    assert m["errors"] >= 1 and m["hits"] == 0
    assert sum("unavailable" in r.message for r in caplog.records) == 1   # logged once
    make_redis(port=server.port)                          # back (empty) on the same port
    time.sleep(tier.backoff + 0.1)
    llm.generate([filler], GREEDY, use_tqdm=False)        # evicts doc again: now written down
    assert llm.get_metrics()["kv_tiers"]["redis"]["entries_written"] >= 25
    out = llm.generate([doc], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 400 and out.outputs[0].token_ids == reference


def test_redis_unreachable_at_start(make_redis, doc, reference):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                          # nothing listens there
    llm = LLM(kv_cache_memory="64MiB", max_model_len=512, kv_tiers=[f"redis://127.0.0.1:{port}/0"], dtype="float32")
    out = llm.generate([doc], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference
    llm.reset_prefix_cache(offload=True)
    m = llm.get_metrics()["kv_tiers"]["redis"]
    assert m["errors"] >= 1 and m["hits"] == 0 and m["entries_written"] == 0


def test_redis_hung_server_means_misses_within_the_timeout(make_redis, llm, doc, filler, reference):
    server = make_redis()
    hung = LLM(kv_cache_memory="64MiB", max_model_len=512, kv_tiers=[server.url + "?socket_timeout=0.3"],
               dtype="float32")
    tier = hung.engine.tiers.tiers[0]
    waits = []
    for name in ("contains", "get"):                      # time every call the step thread makes
        def timed(*args, _call=getattr(tier, name)):
            t0 = time.perf_counter()
            try:
                return _call(*args)
            finally:
                if threading.current_thread() is threading.main_thread():
                    waits.append(time.perf_counter() - t0)
        setattr(tier, name, timed)
    hung.generate([doc[:40]], GREEDY, use_tqdm=False)     # connected; its 2 blocks written through
    os.kill(server.proc.pid, signal.SIGSTOP)              # the server hangs: connections open, no answers
    try:
        out = hung.generate([doc], GREEDY, use_tqdm=False)[0]  # lookups time out: misses
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == 32  # from the device
        other = hung.generate([filler], GREEDY, use_tqdm=False)[0]  # and it keeps serving
        assert other.outputs[0].token_ids == llm.generate([filler], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        t0 = time.perf_counter()
        hung.close()                                      # pending writes give up quickly too
        assert time.perf_counter() - t0 < 2.0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    m = hung.get_metrics()["kv_tiers"]["redis"]
    assert m["errors"] >= 1 and m["hits"] == 0 and m["pending_writes"] == 0
    assert max(waits) < 0.3 + 0.5 and sum(waits) < 1.5   # each lookup bounded by the timeout, then backoff


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("fmt", ["int8", "kivi4"])
def test_quantized_format_round_trips_through_a_tier(doc, fmt, policy):
    llm = LLM(kv_cache_memory="32MiB", max_model_len=512, kv_cache_dtype=fmt, block_size=32,
              kv_tiers=[f"cpu:64MiB:{policy}"], dtype="float32")
    first = llm.generate([doc[:100]], GREEDY, use_tqdm=False)[0]
    if policy == "write_back":
        assert llm.get_metrics()["kv_tiers"]["cpu"]["entries_written"] == 0  # nothing before eviction
    llm.reset_prefix_cache(offload=True)                  # write_through: waits for the writer
    assert llm.get_metrics()["kv_tiers"]["cpu"]["entries_written"] == 3     # 96 tokens: 3 full blocks
    again = llm.generate([doc[:100]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 96 and llm.get_metrics()["prefix_cache_hits_by_source"]["cpu"] == 96
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_prometheus_exports_swap_and_tier_metrics():
    from kvserve.server.metrics import ServerMetrics
    snap = {"swap_usage_bytes": 1024, "num_requests_swapped": 1, "num_swapped_out_blocks": 3,
            "num_swapped_in_blocks": 2, "prefix_cache_hits_by_source": {"device": 32, "disk": 16},
            "kv_poisoned_blocks_evicted": 25, "kv_poisoned_prefix_failures": 1,
            "kv_tiers": {"disk": {"hits": 1, "misses": 2, "bytes_read": 10, "bytes_written": 20,
                                  "errors": 1, "corrupt": 1, "usage_bytes": 20, "entries_written": 2,
                                  "write_drops": 4, "flush_seconds": 0.5, "pending_writes": 3,
                                  "refused": 5, "poisoned": 6, "write_errors": 7}}}
    text = ServerMetrics("m", 512).render(snap).decode()
    for line in ('kvserve:swap_usage_bytes{model_name="m"} 1024.0',
                 'kvserve:num_requests_swapped{model_name="m"} 1.0',
                 'kvserve:num_swapped_out_blocks_total{model_name="m"} 3.0',
                 'kvserve:prefix_cache_hits_by_source_total{model_name="m",source="disk"} 16.0',
                 'kvserve:kv_tier_hits_total{model_name="m",tier="disk"} 1.0',
                 'kvserve:kv_tier_errors_total{model_name="m",tier="disk"} 1.0',
                 'kvserve:kv_tier_usage_bytes{model_name="m",tier="disk"} 20.0',
                 'kvserve:kv_tier_written_entries_total{model_name="m",tier="disk"} 2.0',
                 'kvserve:kv_tier_write_drops_total{model_name="m",tier="disk"} 4.0',
                 'kvserve:kv_tier_flush_seconds_total{model_name="m",tier="disk"} 0.5',
                 'kvserve:kv_tier_pending_writes{model_name="m",tier="disk"} 3.0',
                 'kvserve:kv_tier_refused_entries_total{model_name="m",tier="disk"} 5.0',
                 'kvserve:kv_tier_poisoned_entries_total{model_name="m",tier="disk"} 6.0',
                 'kvserve:kv_tier_write_errors_total{model_name="m",tier="disk"} 7.0',
                 'kvserve:kv_poisoned_blocks_evicted_total{model_name="m"} 25.0',
                 'kvserve:kv_poisoned_prefix_failures_total{model_name="m"} 1.0'):
        assert line in text, line


def test_server_shutdown_flushes_the_tiers(llm, monkeypatch):
    from fastapi.testclient import TestClient

    from kvserve.server.app import build_app
    closed = []
    monkeypatch.setattr(llm.engine, "close", lambda: closed.append(True))
    with TestClient(build_app(llm.engine)) as client:    # lifespan start ... shutdown (as on SIGTERM)
        assert client.get("/health").status_code == 200
        assert not closed
    assert closed == [True]


def test_tier_specs_from_config_and_cli(tmp_path):
    from kvserve.cli import build_parser
    from kvserve.config import EngineConfig, parse_tier_spec
    from kvserve.engine.options import engine_options
    assert parse_tier_spec("cpu:4GiB") == TierSpec("cpu", 4 << 30)
    assert parse_tier_spec("disk:/a:b/c:20GiB") == TierSpec("disk", 20 << 30, "/a:b/c")
    assert parse_tier_spec("redis://127.0.0.1:6379/0") == TierSpec("redis", None, "redis://127.0.0.1:6379/0")
    for bad in ("cpu", "cpu:lots", "disk:/x", "disk::1GiB", "s3://bucket", "cpu:0"):
        with pytest.raises(ValueError, match="KV tier"):
            parse_tier_spec(bad)
    # write policies: an optional last ':write_through' or ':write_back'; None = the kind's default
    assert parse_tier_spec("cpu:4GiB:write_through") == TierSpec("cpu", 4 << 30, write_policy="write_through")
    assert parse_tier_spec("disk:/a:b/c:20GiB:write_back") == TierSpec("disk", 20 << 30, "/a:b/c", "write_back")
    assert parse_tier_spec("redis://h:6379/0:write_back") == TierSpec("redis", None, "redis://h:6379/0", "write_back")
    for bad in ("disk:/x:1GiB:writeback", "cpu:write_back", "write_back"):
        with pytest.raises(ValueError, match="write_through"):
            parse_tier_spec(bad)
    policies = [make_tier(parse_tier_spec(t)).write_policy
                for t in ("cpu:1MiB", f"disk:{tmp_path}:1MiB", "cpu:1MiB:write_through", f"disk:{tmp_path}:1MiB:write_back")]
    assert policies == ["write_back", "write_through", "write_through", "write_back"]
    with pytest.raises(ValueError, match="once"):
        engine_options(EngineConfig(kv_tiers=["cpu:1GiB", "cpu:2GiB"], dtype="float32"))
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_tiers=["cpu:1GiB"], enable_prefix_caching=False, dtype="float32").validate()
    args = build_parser().parse_args(["generate", "hi", "--kv-tier", "cpu:1GiB", "--kv-tier",
                                      f"disk:{tmp_path}:1GiB", "--swap-space", "2", "--preemption-mode", "swap"])
    assert args.kv_tiers == ["cpu:1GiB", f"disk:{tmp_path}:1GiB"]
    assert (args.swap_space, args.preemption_mode) == (2.0, "swap")


# ---- poisoned and forged entries --------------------------------------------------------------
def test_a_poisoned_disk_entry_fails_one_request_and_is_evicted(tmp_path, llm, doc, reference):
    tiers = [f"disk:{tmp_path}:1GiB"]
    engine = LLM(kv_cache_memory="64MiB", max_model_len=512, kv_tiers=tiers, dtype="float32")
    assert engine.generate([doc], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference
    engine.engine.tiers.flush()
    disk = engine.engine.tiers.tiers[0]
    keys = tier_keys(engine.engine, doc)
    assert disk.contains(keys) == [True] * 25
    poison_entry(disk._path(keys[3]))                     # random payload, CRC fixed up: every check passes
    engine.reset_prefix_cache()                           # the device forgets: the disk serves the prefix
    failed = engine.generate([doc], GREEDY, use_tqdm=False)[0]
    assert failed.error is not None and "NaN or infinite" in failed.error and "evicted" in failed.error
    assert failed.prefix_fault and failed.num_cached_tokens == 400
    m = engine.get_metrics()
    assert m["kv_poisoned_blocks_evicted"] == 25 and m["kv_poisoned_prefix_failures"] == 1
    assert m["kv_tiers"]["disk"]["poisoned"] == 25 and m["kv_tiers"]["disk"]["hits"] == 25
    assert not disk._path(keys[3]).exists() and disk.contains(keys) == [False] * 25
    assert engine.engine.kv.pool.num_cached == 0          # nothing of the prefix left on the device
    assert all_blocks_free(engine)
    again = engine.generate([doc], GREEDY, use_tqdm=False)[0]   # the retry recomputes from scratch
    assert again.error is None and again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == reference
    engine.close()
    assert disk.contains(keys) == [True] * 25             # written again, from the recomputed blocks
    assert all_blocks_free(engine)
    fresh = LLM(kv_cache_memory="64MiB", max_model_len=512, kv_tiers=tiers, dtype="float32")
    out = fresh.generate([doc], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 400 and out.outputs[0].token_ids == reference
    assert fresh.get_metrics()["kv_poisoned_blocks_evicted"] == 0


def _keyed(tiers: list[str], key: bytes | None = None, **extra) -> LLM:
    options = {"kv_tier_key": key.decode()} if key is not None else {}
    return LLM(kv_cache_memory="32MiB", max_model_len=512, kv_tiers=tiers, dtype="float32", **options, **extra)


def _run(engine: LLM, prompt):
    out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    engine.close()
    return out, engine.get_metrics()["kv_tiers"]


def test_signed_disk_entries_are_served_only_under_the_writers_key(tmp_path, llm, doc):
    prompt = doc[:100]                                    # 6 full blocks
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiers = [f"disk:{tmp_path}:1GiB"]
    key_file = tmp_path.parent / f"{tmp_path.name}.key"
    key_file.write_bytes(KEY_A + b"\n")
    out, _ = _run(_keyed(tiers, kv_tier_key_file=str(key_file)), prompt)   # key A, from a file
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 6 and all(p.read_bytes()[:4] == b"KVH1" for p in files)
    same, stats = _run(_keyed(tiers, KEY_A), prompt)
    assert same.num_cached_tokens == 96 and stats["disk"]["hits"] == 6 and stats["disk"]["refused"] == 0
    assert same.outputs[0].token_ids == out.outputs[0].token_ids == cold
    keyless, stats = _run(_keyed(tiers), prompt)          # no key: signed entries refused, kept
    assert keyless.num_cached_tokens == 0 and stats["disk"]["refused"] >= 1 and stats["disk"]["hits"] == 0
    assert keyless.outputs[0].token_ids == cold and all(p.exists() for p in files)
    tampered = bytearray(files[0].read_bytes())
    tampered[-100] ^= 0x01                                # one bit of one payload
    files[0].write_bytes(bytes(tampered))
    partial, stats = _run(_keyed(tiers, KEY_A), prompt)
    assert stats["disk"]["refused"] == 1 and partial.num_cached_tokens < 96
    assert partial.outputs[0].token_ids == cold
    other, stats = _run(_keyed(tiers, KEY_B), prompt)     # key B: every entry refused, a miss
    assert other.num_cached_tokens == 0 and stats["disk"]["hits"] == 0 and stats["disk"]["refused"] >= 1
    assert other.outputs[0].token_ids == cold


def test_signed_redis_entries_are_refused_under_another_key(redis_server, llm, doc):
    prompt = doc[:100]
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiers = [redis_server.url]
    _run(_keyed(tiers, KEY_A), prompt)
    other, stats = _run(_keyed(tiers, KEY_B), prompt)
    assert other.num_cached_tokens == 0 and stats["redis"]["refused"] == 6 and stats["redis"]["hits"] == 0
    assert other.outputs[0].token_ids == cold
    same, stats = _run(_keyed(tiers, KEY_B), prompt)      # B deleted A's entries and wrote its own
    assert same.num_cached_tokens == 96 and stats["redis"]["hits"] == 6 and same.outputs[0].token_ids == cold


def test_tier_key_options_are_checked_before_the_model_loads(tmp_path):
    from kvserve.cli import build_parser
    from kvserve.config import EngineConfig
    from kvserve.engine.options import engine_options
    tiers = [f"disk:{tmp_path}:1GiB"]
    with pytest.raises(ValueError, match="at least 16"):
        engine_options(EngineConfig(kv_tiers=tiers, kv_tier_key="short", dtype="float32"))
    with pytest.raises(ValueError, match="cannot read kv_tier_key_file"):
        engine_options(EngineConfig(kv_tiers=tiers, kv_tier_key_file=str(tmp_path / "missing"), dtype="float32"))
    with pytest.raises(ValueError, match="not both"):
        engine_options(EngineConfig(kv_tiers=tiers, kv_tier_key="k" * 16, kv_tier_key_file="f", dtype="float32"))
    with pytest.raises(ValueError, match=r"give kv_tiers \(or kv_transfer_config\) too"):
        engine_options(EngineConfig(kv_tier_key="k" * 16, dtype="float32"))
    secret = "s3cret-s3cret-s3cret"
    assert secret not in repr(EngineConfig(kv_tiers=tiers, kv_tier_key=secret))
    args = build_parser().parse_args(["generate", "hi", "--kv-tier", tiers[0], "--kv-tier-key-file", "/k"])
    assert (args.kv_tier_key, args.kv_tier_key_file) == (None, "/k")
