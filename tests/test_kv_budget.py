"""Tokens a KV budget holds per format, KIVI's residual rows and the block size KIVI picks."""

import logging

import pytest
from helpers import all_blocks_free, assert_same_completions

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, parse_bytes
from kvserve.engine.engine import LLMEngine
from kvserve.engine.options import engine_options

BUDGETS = ["64MiB", "256MiB", "1GiB", "4GiB"]
# tokens per budget over bfloat16's, for the bundled model (3 KV heads x 64 per layer):
# int8 keeps 64 + 2 bytes per vector (a float16 scale), so 128 / 66 = 1.939x is its ceiling; KIVI's packed pages give 3.2x (kivi4) and 5.33x (kivi2), less the residual rows (at most
# 5% of the budget).
MIN_RATIO = {"int8": 1.9, "kivi4": 3.0, "kivi2": 4.5}


@pytest.fixture(scope="module")
def pools():
    """The bundled model in bfloat16 with a 64 MiB pool, one engine per KV format."""
    return {f: LLM(dtype="bfloat16", kv_cache_dtype=f, kv_cache_memory="64MiB", block_size=32, max_model_len=2048)
            for f in ("bfloat16", *MIN_RATIO)}


def planned_pool(llm, budget: str) -> tuple[int, int]:
    """(blocks, residual rows) the engine sizes its pool to for `budget` (the plan the pool is built from)."""
    e = llm.engine
    planner = e.planner
    kept = e.config.kv_cache_memory, planner.residual_rows, planner.plan
    e.config.kv_cache_memory = parse_bytes(budget)
    try:
        plan = planner.plan_pool()
        return plan.num_blocks, planner.residual_rows
    finally:
        e.config.kv_cache_memory, planner.residual_rows, planner.plan = kept


def test_64mib_pool_is_the_plan_and_fits_the_budget(pools):
    for llm in pools.values():
        m = llm.get_metrics()
        assert (m["num_blocks_total"], llm.engine.storage.num_rows) == planned_pool(llm, "64MiB")
        assert m["kv_cache_bytes"] <= 64 << 20


@pytest.mark.parametrize("budget", BUDGETS)
def test_quantized_formats_hold_more_tokens_at_every_budget(pools, budget):
    base, _ = planned_pool(pools["bfloat16"], budget)
    for fmt, ratio in MIN_RATIO.items():
        blocks, rows = planned_pool(pools[fmt], budget)
        assert blocks / base >= ratio, (fmt, budget, blocks, base)
        e = pools[fmt].engine
        row_bytes = rows * 32 * e.kv_format.residual_bytes_per_token
        assert blocks * 32 * e.page_bytes_per_token + row_bytes <= parse_bytes(budget)
        if rows:
            assert 2 <= rows <= e.config.max_num_seqs and row_bytes <= 0.05 * parse_bytes(budget) + row_bytes // rows


# ---- residual rows run out: requests wait or are preempted, outputs unchanged -------------------------

PROMPTS = [f"Story {i}: once upon a time, in a land of rivers and hills, there lived a" for i in range(4)]
PARAMS = [SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True, n=1 + i % 2)
          for i in range(len(PROMPTS))]


def _kivi_engine(**kw):
    # float32 rows of 32 tokens take 1.4 MiB: a 32 MiB budget gives 2 rows, the minimum for one sequence
    return LLM(dtype="float32", kv_cache_dtype="kivi4", kv_cache_memory="32MiB", block_size=32, max_model_len=512,
               max_num_seqs=4, max_num_batched_tokens=40, **kw)


@pytest.fixture(scope="module")
def one_at_a_time():
    """The oracle: each prompt alone, so no request ever waits for a row (KIVI's result depends on
    positions only, not on how the work was batched)."""
    llm = _kivi_engine()
    return [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(PROMPTS, PARAMS)]


def _watch(llm) -> list[tuple[int, int, int, int]]:
    """Record (rows the scheduler counts, rows the storage has, requests running, requests waiting)
    after every schedule."""
    e = llm.engine
    seen, schedule = [], e.scheduler.schedule

    def recorded():
        out = schedule()
        s = e.scheduler
        seen.append((e.kv.rows_held, e.storage.num_rows, len(s.running), len(s.waiting)))
        return out
    e.scheduler.schedule = recorded
    return seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_running_out_of_residual_rows_waits_and_preempts_without_harm(one_at_a_time, mode):
    llm = _kivi_engine(preemption_mode=mode, swap_space=0.25 if mode == "swap" else 0.0)
    e = llm.engine
    assert e.kv_residual_rows == 2 and e.kv.residual_rows == 2
    assert e.kv.num_blocks >= 4 * e.kv.blocks_for_tokens(512)  # blocks are plenty: rows are the limit
    seen = _watch(llm)
    together = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    # batching moves float32 keys by ~1e-7, which can flip a 4-bit code: 4e-3 with rows to spare too
    assert_same_completions(together, one_at_a_time, tol=1e-2)
    assert all(held <= 2 and rows == 2 for held, rows, _, _ in seen)  # never more rows than the budget gave
    assert max(r for _, _, r, _ in seen) <= 2 and max(w for _, _, _, w in seen) >= 2  # requests waited for rows
    assert e.scheduler.num_preemptions > 0  # a fork (n=2) shares its parent's row, then needs its own
    if mode == "swap":
        assert e.scheduler.num_swap_preemptions > 0
    assert all_blocks_free(llm) and e.kv.rows_held == 0


# ---- KIVI picks its block size ----------------------------------------------------------------------


def test_block_size_defaults_to_16_and_to_32_for_kivi(caplog):
    plain = EngineConfig(dtype="float32")
    assert engine_options(plain).block_size == 16 and plain.block_size is None   # a copy, normalised
    given = EngineConfig(kv_cache_dtype="kivi2", block_size=64, dtype="float32")
    assert engine_options(given).block_size == 64
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        engine_options(EngineConfig(kv_cache_dtype="kivi4", block_size=16, dtype="float32"))
    with caplog.at_level(logging.INFO, logger="kvserve"):  # what LLM(kv_cache_dtype="kivi4") builds
        engine = LLMEngine(EngineConfig(kv_cache_dtype="kivi4", kv_cache_memory="16MiB", max_model_len=64, dtype="float32"))
    assert engine.config.block_size == 32 and engine.pool_plan.block_size == 32
    assert any("block_size 32 chosen for kivi4" in r.message for r in caplog.records)
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=4))
    done = [o for _ in range(8) for o in engine.step() if o.finished]
    assert len(done) == 1 and len(done[0].outputs[0].token_ids) == 4
