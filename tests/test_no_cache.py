"""No-cache mode (kv_cache_mode='none'): a KV manager that holds nothing, and the oracle it serves."""

from helpers import assert_same_completions

from kvserve import SamplingParams
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.no_cache import NoCacheManager, NoCacheStorage


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_manager_holds_nothing_and_every_allocation_succeeds():
    kv = NoCacheManager()
    assert not kv.holds_kv
    assert kv.get_computed_blocks("a", list(range(100))) == ([], 0)
    assert kv.allocate_slots("a", 0, 10_000)
    assert kv.allocate_slots("a", 10_000, 1, [])
    kv.set_salt("a", "salt")
    kv.set_retention("a", None, 100)
    kv.cache_blocks("a", list(range(100)), 100)
    kv.fork("a", "b")
    assert kv.block_ids("a") == [] and kv.reqs == {}
    assert kv.take_pending_copies() == []
    assert kv.usage() == 0.0 and kv.num_blocks == 0 and kv.max_blocks_for_tokens(10_000) == 0
    assert kv.pool.num_free == kv.pool.num_usable == kv.pool.num_cached == 0 and not kv.pool.blocks
    assert kv.stats.queries == kv.stats.hits == 0
    kv.free("a")
    kv.drop_salt("a")
    assert kv.reset_prefix_cache(offload=True) == 0
    storage = NoCacheStorage()
    storage.copy_blocks([])
    assert storage.nbytes == storage.residual_nbytes == 0


def test_scheduler_reruns_whole_sequences_over_the_no_cache_manager():
    kv = NoCacheManager()
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8)
    reqs = [_request("a", 20), _request("b", 5), _request("c", 3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()  # no token budget: each admitted request's whole sequence runs
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 20), ("b", 5)]
    assert not out.preempted and [r.request_id for r in sched.waiting] == ["c"]
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        r.append_token(7, 0.0, None)
    again = sched.schedule()  # nothing was kept: every running request runs from token 0 again
    assert [(r.request_id, n) for r, n in again.scheduled] == [("a", 21), ("b", 6)]
    assert all(r.num_computed_tokens == 0 for r, _ in again.scheduled)
    sched.finish(reqs[0], RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r, _ in sched.schedule().scheduled] == ["b", "c"]
    assert kv.usage() == 0.0 and kv.reqs == {}


def test_no_cache_engine_holds_no_blocks_and_equals_cached_greedy(llm, llm_nocache):
    prompts = ["The capital of France is", "Q: What is 12 times 12?\nA:", "List three colours:"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    ref = llm_nocache.generate(prompts, params, use_tqdm=False)
    assert_same_completions(llm.generate(prompts, params, use_tqdm=False), ref)
    engine = llm_nocache.engine
    assert type(engine.kv) is NoCacheManager and type(engine.storage) is NoCacheStorage
    assert engine.runner.backends == [] and engine.swap is None
    m = llm_nocache.get_metrics()
    assert m["num_blocks_total"] == m["num_blocks_used"] == m["kv_cache_bytes"] == 0
    assert m["kv_cache_usage"] == 0.0 and m["prefix_cache_queries"] == m["prefix_cache_hits"] == 0
    assert llm_nocache.engine.reset_prefix_cache() == 0


def test_kv_state_of_a_no_cache_engine_shows_an_empty_pool(llm_nocache):
    from kvserve.server.kv_state import KVStateTracker

    engine = llm_nocache.engine
    llm_nocache.engine.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    snap = KVStateTracker(engine).snapshot(engine)
    assert snap["pool"] == {"counts": {"f": 0, "c": 0, "u": 0, "s": 0}, "state": "", "ref": [], "group": [],
                            "hash": "", "holders": {}, "pinned": []}
    assert snap["kv"]["mode"] == "none" and snap["kv"]["num_blocks"] == 0 and not snap["kv"]["prefix_caching"]
    assert [r["blocks"] for r in snap["requests"]] == [[]]
    assert snap["counters"]["kv_usage"] == 0.0 and snap["counters"]["prefix_hits"] == 0
    while engine.has_unfinished_requests():
        engine.step()
