"""Swap: preempted requests move their KV to a host pool and back, with identical greedy results."""

from __future__ import annotations

import pytest
import torch
from helpers import all_blocks_free

from kvserve import LLM, SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import FullSpec, KVGroup
from kvserve.kv.storage import KVStorage
from kvserve.kv.swap import SwapSpace

STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
         "woodcutter and his three daughters. Every morning he")
PROMPTS = [f"{STORY} ({i})" for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
BLOCK_BYTES = 16 * 46080                 # one block of SmolLM2 in float32
TINY = dict(kv_cache_memory=24 * BLOCK_BYTES, max_model_len=384, dtype="float32")  # 24 blocks for 6 x ~6 blocks


def outputs(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens of the same model and dtype in a pool that holds every request (no preemption;
    cached decoding itself is checked against full recompute in test_engine.py)."""
    before = llm.get_metrics()["num_preemptions"]
    out = outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.get_metrics()["num_preemptions"] == before
    return out


def test_swap_tiny_pool_same_outputs(reference):
    tiny = LLM(**TINY, swap_space=0.05, preemption_mode="swap")
    out = tiny.generate(PROMPTS, GREEDY, use_tqdm=False)
    m = tiny.get_metrics()
    assert outputs(out) == reference
    assert m["num_preemptions"] > 0 and m["num_swap_preemptions"] == m["num_preemptions"]
    assert m["num_swapped_out_blocks"] == m["num_swapped_in_blocks"] > 0
    assert m["swap_usage_bytes"] == 0 and m["num_requests_swapped"] == 0
    assert all_blocks_free(tiny)


def test_full_swap_space_falls_back_to_recompute(reference):
    tiny = LLM(**TINY, swap_space=4 * BLOCK_BYTES / (1 << 30), preemption_mode="swap")  # 4 host blocks
    out = tiny.generate(PROMPTS, GREEDY, use_tqdm=False)
    m = tiny.get_metrics()
    assert outputs(out) == reference
    assert m["num_recompute_preemptions"] > 0                       # a victim did not fit in 4 blocks
    assert m["swap_usage_bytes"] == 0 and all_blocks_free(tiny)


# KIVI's small pools get 2 residual rows, so 2 sequences run at once: 5 blocks make one of them
# swap when both grow to 3 blocks (max_model_len 96 lets a pool of 3 blocks start)
@pytest.mark.parametrize("fmt, max_model_len, num_blocks, num_prompts", [("int8", 384, 13, 6), ("kivi4", 96, 5, 3)])
def test_swap_with_quantized_formats(fmt, max_model_len, num_blocks, num_prompts):
    """Every tensor of every slot moves (scales, zero points; KIVI's still-filling residual rows)."""
    opts = dict(max_model_len=max_model_len, block_size=32, kv_cache_dtype=fmt, max_num_seqs=6, dtype="float32")
    big = LLM(**opts, kv_cache_memory="32MiB")
    prompts = PROMPTS[:num_prompts]
    ref = outputs(big.generate(prompts, GREEDY, use_tqdm=False))
    fmt_plan = big.engine.kv_format
    del big
    tiny = LLM(**opts, kv_cache_memory=_pool_bytes(fmt_plan, num_blocks, 2), swap_space=0.05,
               preemption_mode="swap")
    out = outputs(tiny.generate(prompts, GREEDY, use_tqdm=False))
    m = tiny.get_metrics()
    assert m["num_blocks_total"] == num_blocks
    assert m["num_swap_preemptions"] > 0
    assert out == ref
    assert m["swap_usage_bytes"] == 0 and all_blocks_free(tiny)


def _pool_bytes(fmt, num_blocks: int, rows: int) -> int:
    """kv_cache_memory for `num_blocks` blocks in format `fmt` plus `rows` residual rows (KIVI)."""
    return fmt.block_size * (num_blocks * fmt.page_bytes_per_token + rows * fmt.residual_bytes_per_token)


def test_abort_swapped_request_frees_host_blocks(reference):
    tiny = LLM(**TINY, swap_space=0.05, preemption_mode="swap")
    engine = tiny.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.get_metrics()["num_requests_swapped"] == 0:
        assert engine.has_unfinished_requests()
        engine.step()
    victim = next(r for r in ids if engine.swap.is_swapped(r))
    before = engine.get_metrics()["swap_usage_bytes"]
    engine.abort_request(victim)
    assert engine.get_metrics()["swap_usage_bytes"] < before
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[r] for r in ids if r != victim] == [ref for r, ref in zip(ids, reference) if r != victim]
    assert engine.get_metrics()["swap_usage_bytes"] == 0 and all_blocks_free(tiny)


# ---- units -----------------------------------------------------------------------------------
def unit_swap(num_blocks=8, host_blocks=6, block_size=4):
    groups = [KVGroup(FullSpec(num_kv_heads=2, head_dim=3), [0, 1])]
    kv = KVCacheManager(num_blocks, block_size, namespace_hash("unit", "swap"), groups=groups)
    storage = KVStorage(groups, num_blocks, block_size, torch.float32)
    return kv, storage, SwapSpace(storage, kv, host_blocks)


def test_swap_round_trip_new_block_ids_same_bytes():
    kv, storage, swap = unit_swap()
    assert kv.allocate_slots("a", 0, 10)                  # 3 blocks; 10 tokens computed
    old = list(kv.block_ids("a"))
    storage.write_blocks(old, [torch.randn((3, *s), dtype=d) for d, s in storage.block_layout()])
    saved = [t.clone() for t in storage.read_blocks(old)]
    assert swap.swap_out("a", 10)
    assert swap.usage_bytes == 3 * storage.bytes_per_block and kv.pool.num_free == 8
    assert kv.allocate_slots("b", 0, 24)                  # someone else takes (and overwrites) 6 blocks
    storage.write_blocks(kv.block_ids("b"), [torch.zeros((6, *s), dtype=d) for d, s in storage.block_layout()])
    grow = lambda: kv.allocate_slots("a", 10, 6)          # noqa: E731 (16 tokens: one block more)
    assert not swap.swap_in("a", grow)                    # 2 free < 3 blocks to restore
    kv.free("b")
    assert kv.allocate_slots("c", 0, 20)                  # 5 blocks: 3 free, restore fits, growing not
    assert not swap.swap_in("a", grow) and kv.pool.num_free == 3 and swap.is_swapped("a")
    kv.free("c")
    assert swap.swap_in("a", grow)
    new = kv.block_ids("a")[:3]
    assert all(torch.equal(x, y) for x, y in zip(storage.read_blocks(new), saved))
    assert swap.usage_bytes == 0 and not swap.is_swapped("a")
    assert swap.num_swapped_out_blocks == swap.num_swapped_in_blocks == 3


def test_swap_out_refused_when_host_pool_is_full():
    kv, storage, swap = unit_swap(host_blocks=2)
    assert kv.allocate_slots("a", 0, 12)
    assert not swap.swap_out("a", 12)                     # 3 blocks > 2 host blocks: nothing changes
    assert len(kv.block_ids("a")) == 3 and swap.usage_bytes == 0


def test_auto_mode_compares_copy_time_with_recompute_time():
    kv, storage, swap = unit_swap()
    sched = Scheduler(kv, 8, 64, swap, "auto")
    assert kv.allocate_slots("r", 0, 12)

    class Req:
        request_id, num_computed_tokens = "r", 12

    swap.copy_bytes_per_s = 1e9                           # 3 blocks out and back: 2 * 3 * 96 B / 1e9
    sched.seconds_per_token = 1e-3                        # recompute 12 tokens: 12 ms
    assert sched._prefer_swap(Req)
    sched.seconds_per_token = 1e-12
    assert not sched._prefer_swap(Req)
    sched.preemption_mode = "recompute"
    sched.seconds_per_token = 1.0
    assert not sched._prefer_swap(Req)
    sched.observe_step(128, 0.128)                        # learns from prefill-sized steps
    assert sched.seconds_per_token == pytest.approx(0.8 * 1.0 + 0.2 * 1e-3)


def test_config_checks():
    from kvserve.config import EngineConfig
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop", dtype="float32").validate()
    with pytest.raises(ValueError, match="swap_space > 0"):
        EngineConfig(preemption_mode="swap", dtype="float32").validate()
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=-1, dtype="float32").validate()


def test_kivi_still_filling_block_moves_with_its_residual_row():
    """A swap-in into a block whose previous owner just filled it (its row release still pending)."""
    from kvserve.kv.formats import build_kv_format
    groups = [KVGroup(FullSpec(num_kv_heads=3, head_dim=64), [0, 1])]
    fmt = build_kv_format(groups, torch.float32, 32, "kivi4")
    st = KVStorage(groups, 8, 32, torch.float32, "cpu", fmt, residual_rows=4, block_is_free=lambda b: False)
    g = torch.Generator().manual_seed(0)

    def kv(n):
        return torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g)

    part = 3 * 32 + torch.arange(8)                      # block 3: 8 tokens, still filling
    for layer in (0, 1):
        st.write(layer, part, *kv(8))
    want = [st.read(layer, part) for layer in (0, 1)]
    saved, rows = st.read_blocks([3]), st.export_residual([3])
    for n0, n1 in ((0, 31), (31, 32)):                   # another request fills block 5, the last slot
        x = kv(n1 - n0)                                  # by decode: its row's release waits a step
        for layer in (0, 1):
            st.write(layer, 5 * 32 + torch.arange(n0, n1), *x)
    st.write_blocks([5], saved)                          # block 5 reused at once for the swapped-in data
    st.import_residual([5], rows)
    nxt = kv(1)
    for layer in (0, 1):                                 # the next step writes token 8 of the moved block
        st.write(layer, torch.tensor([5 * 32 + 8]), *nxt)
    got = [st.read(layer, 5 * 32 + torch.arange(8)) for layer in (0, 1)]
    assert all(torch.equal(a, b) for w, r in zip(want, got) for a, b in zip(w, r))
