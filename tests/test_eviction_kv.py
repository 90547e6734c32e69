"""kv/evictor.py on its own: a KV manager and storage with one group of two layers, a request
whose keys and values name their layer and position, and the entries, tables and pool after
eviction, worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvserve.kv.evictor import Evictor
from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.policies import parse_policy
from kvserve.kv.spec import FullSpec, KVGroup
from kvserve.kv.storage import KVStorage

BS, N = 4, 10   # block size; tokens the request has computed


def shift_down(k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in for RoPE re-rotation: keys hold their position, moving delta back subtracts it."""
    return k - delta.view(-1, 1, 1).to(k.dtype)


def setup(num_blocks: int = 8):
    groups = [KVGroup(FullSpec(num_kv_heads=1, head_dim=2), [0, 1])]
    storage = KVStorage(groups, num_blocks, BS, torch.float32)
    kv = KVCacheManager(num_blocks, BS, namespace_hash("unit", "evictor"), groups=groups,
                        eviction=lambda m: Evictor(m, storage, groups, num_heads=1, num_kv_heads=1,
                                                   shift_keys=[shift_down, shift_down]))
    req = SimpleNamespace(request_id="r", num_computed_tokens=N, num_prompt_tokens=N, is_finished=False)
    assert kv.allocate_slots("r", 0, N)
    slots = kv.slots("r", 0, torch.arange(N))
    for layer in (0, 1):
        k = (100.0 * layer + torch.arange(N, dtype=torch.float32)).view(N, 1, 1).expand(N, 1, 2)
        storage.write(layer, slots, k, -k)
    return kv, storage, req


def entries(kv, storage, rid: str, layer: int, n: int) -> tuple[list[float], list[float]]:
    k, v = storage.read(layer, kv.slots(rid, 0, torch.arange(n)))
    return k[:, 0, 0].tolist(), v[:, 0, 0].tolist()


def test_sinks_keep_order_re_rotate_moved_keys_in_every_layer_of_the_group():
    kv, storage, req = setup()
    ev = kv.eviction
    ev.add(req, parse_policy("sinks:2,4").resolve(N))
    table = list(kv.block_ids("r"))
    ev.after_step([(req, N)])
    assert ev.cache_len(req, 0) == 6 and ev.position_shift(req) == 4
    assert kv.block_ids("r") == table[:2] and kv.pool.num_free == 8 - 2
    for layer in (0, 1):
        base = 100.0 * layer
        k, v = entries(kv, storage, "r", layer, 6)
        assert k == [base + i for i in range(6)]                       # re-indexed: key = new index
        assert v == [-(base + p) for p in (0, 1, 6, 7, 8, 9)]          # values move as they are
    assert ev.states["r"].pos[0].tolist() == [0, 1, 6, 7, 8, 9]
    m = ev.metrics()
    assert m["kv_evicted_entries"] == 8 and m["kv_evicted_tokens"] == 4 and m["kv_eviction_blocks_freed"] == 1
    assert m["kv_eviction_entries_moved"] == 8                         # 4 tokens x 2 layers


def test_kept_positions_fill_holes_from_the_tail_with_raw_moves():
    kv, storage, req = setup()
    ev = kv.eviction
    ev.add(req, parse_policy("h2o:2,4").resolve(N))   # no scores seen: ties keep the earliest
    ev.after_step([(req, N)])
    assert ev.cache_len(req, 0) == 6 and ev.position_shift(req) == 0
    for layer in (0, 1):
        base = 100.0 * layer
        k, v = entries(kv, storage, "r", layer, 6)
        assert k == [base + p for p in (0, 1, 6, 7, 8, 9)] and v == [-x for x in k]
    assert ev.metrics()["kv_eviction_blocks_freed"] == 1


def test_a_fork_keeps_its_entries_when_its_sibling_evicts():
    kv, storage, req = setup()
    ev = kv.eviction
    ev.add(req, parse_policy("sinks:2,4").resolve(N))
    kv.fork("r", "s")
    shared = list(kv.block_ids("s"))
    ev.after_step([(req, N)])
    assert kv.block_ids("s") == shared                                 # the sibling's table is untouched
    assert kv.block_ids("r")[0] not in shared and kv.block_ids("r")[1] not in shared
    assert ev.metrics()["kv_eviction_blocks_unshared"] == 2
    assert entries(kv, storage, "s", 1, N)[0] == [100.0 + p for p in range(N)]
    assert entries(kv, storage, "r", 1, 6)[0] == [100.0 + i for i in range(6)]
    kv.free("r")
    kv.free("s")
    assert kv.pool.num_free == 8


def test_eviction_waits_when_no_block_is_free_to_unshare_into():
    kv, storage, req = setup(num_blocks=4)            # 3 blocks taken, 1 free, 2 to unshare
    ev = kv.eviction
    ev.add(req, parse_policy("sinks:2,4").resolve(N))
    kv.fork("r", "s")
    ev.after_step([(req, N)])
    assert ev.cache_len(req, 0) == N and ev.metrics()["kv_evictions_deferred"] == 1
