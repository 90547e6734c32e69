"""KV eviction (kv/policies.py, kv/evictor.py): selection on hand-built scores, decode equal to a
no-cache recompute over exactly the kept tokens, blocks given back to the pool, long streams."""

import math

import pytest
import torch
from family_checkpoints import make_tiny_checkpoint
from helpers import all_blocks_free

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata, PrefillSpan
from kvserve.kv.policies import (
    KVPolicy,
    keep_heavy_recent,
    keep_random,
    keep_sinks_window,
    keep_window_and_top,
    parse_policy,
    snapkv_scores,
)

BS = 4
TOKEN_BYTES = 2 * 2 * 16 * 4  # K and V, 2 KV heads x head_dim 16, float32: one layer of the tiny llama


@pytest.fixture(scope="module")
def tiny1(tmp_path_factory):
    """One-layer tiny llama (max_position_embeddings 64): its K/V depend only on (token, position),
    so a recompute over the kept tokens is an exact oracle for the cached path after eviction."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("one"), num_hidden_layers=1,
                                max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory):
    """Two-layer tiny llama: layers choose different tokens."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("two"), num_hidden_layers=2,
                                max_position_embeddings=64)


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def tiny_mla(request, tmp_path_factory):
    """One MLA layer (cache entry: the latent [c_kv, k_pe]); V2 stores k_pe pairs interleaved, V3 as
    two halves, here with yarn (cos/sin carry the mscale factor 1.07)."""
    extra = {} if request.param == "deepseek_v2" else dict(rope_scaling={
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0})
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), num_hidden_layers=1,
                                max_position_embeddings=64, **extra)


def tiny_llm(path, policy, blocks=512, layers=1, **kw):
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("dtype", "float32")  # the oracle mode
    return LLM(path, kv_cache_memory=blocks * BS * TOKEN_BYTES, block_size=BS, max_model_len=kw.pop("max_model_len", 400),
               kv_policy=policy, **kw)


def stream_peak_blocks(llm, prompt, n) -> int:
    """Run one request of n greedy tokens step by step; the most blocks the pool had in use."""
    eng, peak = llm.engine, 0
    eng.add_request(prompt, greedy(n))
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, llm.get_metrics()["num_blocks_used"])
    return peak


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


# ---- parsing ------------------------------------------------------------------------------------------


def test_parse_policy_specs():
    assert parse_policy("sinks:4,1020") == KVPolicy("sinks", sinks=4, recent=1020)
    assert parse_policy("sinks:512") == KVPolicy("sinks", sinks=4, recent=512)
    assert parse_policy("window:256") == KVPolicy("window", recent=256)
    assert parse_policy("h2o:64,32") == KVPolicy("h2o", heavy=64, recent=32)
    assert parse_policy("snapkv:1024,16,5,avg") == KVPolicy("snapkv", budget=1024, window=16, kernel=5, pool="avg")
    assert parse_policy(None) == parse_policy("full") == KVPolicy()
    half = parse_policy("snapkv:0.5")
    assert not half.is_resolved and half.resolve(1000).budget == 500 and half.resolve(1000).is_resolved
    assert parse_policy("h2o:0.1,0.1").resolve(200) == KVPolicy("h2o", heavy=20, recent=20)
    for text in ("sinks:4,1020", "window:8", "h2o:64,32", "snapkv:100,32,7,max", "random:50,8,3", "full"):
        assert parse_policy(parse_policy(text).spec()) == parse_policy(text)
    for bad in ("sink:4,8", "sinks:a,8", "h2o:64", "snapkv:1.5", "snapkv:10,4,3,mean", "window:0", "window:1,2"):
        with pytest.raises(ValueError, match="kv_policy"):
            parse_policy(bad)
    with pytest.raises(ValueError, match="kv_policy"):
        SamplingParams(kv_policy="sinks:x")


def test_cache_bounds():
    sinks = parse_policy("sinks:4,60")
    assert sinks.cache_bound(prompt_len=10, total_len=1000, chunk=32) == 64 + 10
    assert sinks.cache_bound(prompt_len=500, total_len=1000, chunk=32) == 64 + 32
    assert sinks.cache_bound(prompt_len=5, total_len=20, chunk=32) == 20
    snap = parse_policy("snapkv:100")
    assert snap.cache_bound(prompt_len=400, total_len=420, chunk=32) == 400
    assert snap.cache_bound(prompt_len=400, total_len=800, chunk=32) == 100 + 400


# ---- selection on hand-built scores ---------------------------------------------------------------------


def test_sinks_and_window_selection():
    pos = torch.arange(10)
    assert keep_sinks_window(pos, 2, 3).tolist() == [0, 1, 7, 8, 9]
    assert keep_sinks_window(pos, 0, 4).tolist() == [6, 7, 8, 9]
    assert keep_sinks_window(pos, 4, 8).tolist() == list(range(10))     # under budget: everything
    scrambled = torch.tensor([5, 0, 9, 2, 7, 1])                        # cache order != position order
    assert keep_sinks_window(scrambled, 1, 2).tolist() == [1, 2, 4]     # positions 0, 9, 7


def test_h2o_selection():
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    scores = torch.tensor([5.0, 0.1, 3.0, 0.2, 4.0, 9.0, 0.0, 0.0])
    # recent = positions 6, 7; heavy = the best two of the rest: 5 (9.0), 0 (5.0)
    assert keep_heavy_recent(pos, scores, heavy=2, recent=2).tolist() == [0, 5, 6, 7]
    # recent entries never count as heavy, whatever their score
    assert keep_heavy_recent(pos, torch.tensor([1.0, 0, 0, 0, 0, 0, 9, 9]), 1, 2).tolist() == [0, 6, 7]
    # ties go to the earlier position
    assert keep_heavy_recent(pos, torch.ones(8), heavy=3, recent=1).tolist() == [0, 1, 2, 7]
    # scrambled cache order: recent by position, not by cache index
    spos = torch.tensor([7, 0, 6, 1, 5, 2])
    assert keep_heavy_recent(spos, torch.tensor([0, 1, 0, 8, 0, 2.0]), 1, 2).tolist() == [0, 2, 3]


def test_snapkv_selection_pools_and_averages_gqa_groups():
    # 4 query heads in 2 KV groups over 8 prompt entries; the last 2 are the observation window
    attn = torch.zeros(4, 8)
    attn[0, 2] = 1.0   # group 0: one head looks at entry 2 (averaged with its silent partner: 0.5)
    attn[2, 4] = 0.4   # group 1: both heads look at entry 4 (0.4)
    attn[3, 4] = 0.4
    flat = snapkv_scores(attn, torch.arange(8), num_kv_heads=2, kernel=1)
    assert torch.allclose(flat, torch.tensor([0, 0, 0.25, 0, 0.2, 0, 0, 0]))
    assert keep_window_and_top(torch.arange(8), flat, budget=3, window=2).tolist() == [2, 6, 7]
    pooled = snapkv_scores(attn, torch.arange(8), num_kv_heads=2, kernel=3)    # max over neighbours
    assert torch.allclose(pooled, torch.tensor([0, 0.25, 0.25, 0.45, 0.2, 0.2, 0, 0]))
    assert keep_window_and_top(torch.arange(8), pooled, budget=4, window=2).tolist() == [1, 3, 6, 7]
    avg = snapkv_scores(attn, torch.arange(8), num_kv_heads=2, kernel=3, pool="avg")
    assert torch.allclose(avg[2], torch.tensor(0.25 / 3)) and torch.allclose(avg[0], torch.tensor(0.0))
    # budget below the window: the newest `budget` entries
    assert keep_window_and_top(torch.arange(8), pooled, budget=1, window=2).tolist() == [7]


def test_random_selection_is_seeded_and_keeps_window():
    pos = torch.arange(100)
    a = keep_random(pos, 20, 5, torch.Generator().manual_seed(1))
    b = keep_random(pos, 20, 5, torch.Generator().manual_seed(1))
    assert a.tolist() == b.tolist() and len(a) == 20 and set(range(95, 100)) <= set(a.tolist())


# ---- the engine: decode over the kept tokens equals a no-cache recompute ---------------------------------


class Oracle:
    """Wraps the runner: before every step, note what each request's cache holds (tokens, the
    positions their keys are rotated at); after it, recompute the sampled logits without a cache over
    exactly those tokens plus the new ones, and record the largest difference."""

    def __init__(self, llm):
        self.eng = llm.engine
        self.worst = 0.0
        self.max_position = 0
        self.checked = 0
        self._run = self.eng.runner.execute
        self.eng.runner.execute = self.execute

    def execute(self, scheduled, prompt_logprob_reqs=()):
        ev = self.eng.evictor
        g = ev.targets[0]   # the (first) layer policies evict from: what the recompute keeps
        before = {}
        for req, n in scheduled:
            st = ev.states.get(req.request_id)
            c = ev.cache_len(req, g)
            kept = ev._positions(st, g, c).clone() if st is not None else torch.arange(c)
            shift = ev.position_shift(req)
            reindex = st is not None and st.policy.reindex
            start = req.num_computed_tokens
            ids = [req.token_ids[p] for p in kept.tolist()] + req.token_ids[start:start + n]
            pos = (list(range(c)) if reindex else kept.tolist()) + list(range(start - shift, start - shift + n))
            before[req.request_id] = (ids, pos)
        inp, logits, extra = self._run(scheduled, prompt_logprob_reqs)
        self.max_position = max(self.max_position, int(inp.positions.max()))
        for req, row in zip(inp.sampling_reqs, logits):
            ids, pos = before[req.request_id]
            ref = self.recompute(ids, pos)
            self.worst = max(self.worst, float((ref - row).abs().max()))
            self.checked += 1
        return inp, logits, extra

    @torch.inference_mode()
    def recompute(self, ids, pos):
        n = len(ids)
        hidden = self.eng.model(torch.tensor(ids), torch.tensor(pos),
                                AttentionMetadata(prefills=[PrefillSpan(0, n, n)]))
        return self.eng.model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("policy", ["sinks:4,12", "window:16", "h2o:6,10", "snapkv:16,4,3", "snapkv:0.5",
                                    "random:16,4"])
def test_decode_equals_recompute_over_kept_tokens(tiny1, policy):
    llm = tiny_llm(tiny1, policy)
    oracle = Oracle(llm)
    prompts = [list(range(3, 40)), list(range(50, 71))]
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert oracle.checked == 80 and oracle.worst < 1e-4, oracle.worst
    m = llm.get_metrics()
    assert m["kv_evicted_tokens"] > 0 and m["kv_evictions"] > 0
    assert all_blocks_free(llm) and not llm.engine.evictor.states


@pytest.mark.parametrize("policy", ["sinks:4,12", "window:16", "h2o:6,10", "snapkv:16,4,3"])
def test_mla_decode_equals_recompute_over_kept_tokens(tiny_mla, policy):
    # re-indexing policies re-rotate only the k_pe part of each cached latent
    llm = tiny_llm(tiny_mla, policy)
    oracle = Oracle(llm)
    outs = llm.generate([list(range(3, 40)), list(range(50, 71))], greedy(40), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert oracle.checked == 80 and oracle.worst < 1e-4, oracle.worst
    assert llm.get_metrics()["kv_evicted_tokens"] > 0
    assert all_blocks_free(llm) and not llm.engine.evictor.states


def test_mla_scores_are_attention_probabilities(tiny_mla):
    # every query row of every head hands out probability 1 over the latents it sees
    llm = tiny_llm(tiny_mla, "h2o:100,100")
    eng = llm.engine
    eng.add_request(list(range(5, 25)), greedy(3))
    eng.step()                                       # the 20-token prompt
    st = next(iter(eng.evictor.states.values()))
    heads = eng.model.config.num_heads
    assert st.scores[0].shape == (20,) and float(st.scores[0].sum()) == pytest.approx(heads * 20, rel=1e-5)
    assert float(st.scores[0][0]) > float(st.scores[0][-1])   # the first latent is seen by all 20 queries
    eng.step()
    assert float(st.scores[0].sum()) == pytest.approx(heads * 21, rel=1e-5)  # + one decode query
    while eng.has_unfinished_requests():
        eng.step()


@pytest.mark.parametrize("policy", ["sinks:4,12", "window:16", "h2o:6,10", "snapkv:16,4,3", "random:16,4"])
def test_parallel_samples_each_decode_over_their_own_kept_tokens(tiny1, policy):
    # n = 3: the children fork from the parent's (already evicted) cache, share its blocks and copy
    # them only when their own eviction writes into them
    llm = tiny_llm(tiny1, policy)
    oracle = Oracle(llm)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    outs = llm.generate([list(range(3, 40)), list(range(50, 71))], params, use_tqdm=False)
    for o in outs:
        seqs = [c.token_ids for c in o.outputs]
        assert len(seqs) == 3 and all(len(t) == 30 for t in seqs) and len({tuple(t) for t in seqs}) == 3
    assert oracle.checked == 2 * (1 + 3 * 29) and oracle.worst < 1e-4, oracle.worst
    m = llm.get_metrics()
    assert m["kv_evicted_tokens"] > 0 and m["kv_evictions_deferred"] == 0
    if parse_policy(policy).one_shot:
        assert m["kv_eviction_blocks_unshared"] == 0     # compressed once, before the fork, then only appended
    else:
        assert m["kv_eviction_blocks_unshared"] > 0
    assert all_blocks_free(llm) and not llm.engine.evictor.states


def test_parallel_samples_share_the_compressed_prompt(tiny1):
    llm = tiny_llm(tiny1, "snapkv:16,4", max_num_batched_tokens=64)
    eng = llm.engine
    eng.add_request(list(range(3, 40)), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True))
    eng.step()                                # prefill, compress to 16 entries = 4 blocks, fork 3 children
    assert len(eng.evictor.states) == 4
    assert llm.get_metrics()["num_blocks_used"] == 4
    eng.step()                                # each sequence appends its token to a block of its own
    assert llm.get_metrics()["num_blocks_used"] == 4 + 4
    while eng.has_unfinished_requests():
        eng.step()
    assert all_blocks_free(llm)


@pytest.mark.parametrize("policy", ["sinks:4,12", "snapkv:16,4"])
def test_parallel_samples_with_eviction_survive_swap_preemption(tiny1, policy):
    # 6 sequences in 18 blocks: forks with compacted (shorter) per-layer tables go to the CPU and back
    llm = tiny_llm(tiny1, policy, blocks=18, max_model_len=64, max_num_batched_tokens=16,
                   preemption_mode="swap", swap_space=0.01)
    oracle = Oracle(llm)
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=30, ignore_eos=True)
    outs = llm.generate([list(range(3, 30)), list(range(40, 60))], params, use_tqdm=False)
    assert all(len(c.token_ids) == 30 for o in outs for c in o.outputs)
    m = llm.get_metrics()
    assert m["num_swap_preemptions"] > 0 and m["num_recompute_preemptions"] == 0
    assert oracle.checked == 2 * (1 + 3 * 29) and oracle.worst < 1e-4, oracle.worst
    assert all_blocks_free(llm) and not llm.engine.evictor.states


@pytest.mark.parametrize("policy", ["sinks:4,12", "h2o:6,10", "snapkv:16,4,3"])
def test_beam_search_beams_evict_on_their_own(tiny1, policy):
    from kvserve import BeamSearchParams
    llm = tiny_llm(tiny1, policy)
    oracle = Oracle(llm)
    out = llm.beam_search([list(range(3, 40))], BeamSearchParams(beam_width=3, max_tokens=24, ignore_eos=True))[0]
    assert len(out.sequences) == 3 and all(len(s.tokens) == 24 for s in out.sequences)
    assert oracle.checked == 1 + 3 * 23 and oracle.worst < 1e-4, oracle.worst
    assert llm.get_metrics()["kv_evicted_tokens"] > 0
    assert all_blocks_free(llm) and not llm.engine.evictor.states


def test_eviction_waits_for_a_free_block_to_unshare_into(tiny1):
    # a 7-block pool: after the fork three sequences share the prompt's 3 blocks and take one each for
    # their first token; copying the shared blocks before compacting finds the pool short, so eviction
    # waits, the pool runs dry and preemption (recompute) makes room; every step stays exact
    llm = tiny_llm(tiny1, "window:12", blocks=7, max_num_batched_tokens=16)
    oracle = Oracle(llm)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    out = llm.generate([list(range(3, 15))], params, use_tqdm=False)[0]
    assert all(len(c.token_ids) == 40 for c in out.outputs)
    assert oracle.worst < 1e-4
    m = llm.get_metrics()
    assert m["kv_evictions_deferred"] > 0 and m["num_preemptions"] > 0
    assert all_blocks_free(llm) and not llm.engine.evictor.states


def test_reindexed_stream_runs_past_max_position_embeddings_in_a_small_pool(tiny1):
    # 16 blocks of 4 tokens = 64 slots for a 308-token stream on a model trained for 64 positions
    llm = tiny_llm(tiny1, "sinks:4,12", blocks=16, max_num_batched_tokens=8)
    oracle = Oracle(llm)
    peak = stream_peak_blocks(llm, list(range(3, 11)), 300)
    assert oracle.worst < 1e-4 and oracle.checked == 300
    assert oracle.max_position <= 16           # positions stay inside the cache: 4 sinks + 12 recent
    assert peak <= math.ceil(17 / BS)          # capacity + the new token, in blocks
    m = llm.get_metrics()
    # 307 tokens were cached (the last sampled one never is); the last step ended the request before
    # its eviction, so 17 were held at the end
    assert m["kv_evicted_tokens"] == 307 - 17
    assert all_blocks_free(llm)


def test_h2o_on_kept_positions_past_the_trained_context(tiny1):
    llm = tiny_llm(tiny1, "h2o:8,8", blocks=16, max_num_batched_tokens=8, max_model_len=200)
    oracle = Oracle(llm)
    llm.generate([list(range(3, 13))], greedy(150), use_tqdm=False)
    assert oracle.worst < 1e-4 and oracle.max_position == 158   # RoPE tables grown past 64
    assert all_blocks_free(llm)


def test_sinks_stream_runs_past_max_model_len_in_a_pool_of_its_bound(tiny1):
    # 80 blocks = 320 slots: sinks:4,252 plus a full 2048-token chunk would not fit, so the prompt runs
    # in chunks of 64 (capacity + chunk = the pool); 300 + 1,200 tokens stream past max_model_len=512
    llm = tiny_llm(tiny1, "sinks:4,252", blocks=80, max_num_batched_tokens=2048, max_model_len=512)
    eng = llm.engine
    assert eng.planner.prefill_chunk(eng.kv_policy) == 64
    oracle = Oracle(llm)
    rid = eng.add_request([3 + i % 250 for i in range(300)], greedy(1200))
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        held.append(eng.evictor.blocks_held(rid))
    assert oracle.checked == 1200 and oracle.worst < 1e-4, oracle.worst
    assert oracle.max_position < 256 + 64           # positions: cache indices, never the stream's length
    assert len(held) == 5 + 1199                    # 5 prompt chunks, then one token per step
    assert max(held) <= 256 // BS                   # after every step: 4 sinks + 252 recent
    assert all_blocks_free(llm)


def test_a_stream_past_max_model_len_needs_positions_below_it(tiny1):
    llm = tiny_llm(tiny1, "sinks:4,60", max_model_len=128, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="raise max_model_len to 164"):     # 64 + a 100-token chunk
        llm.generate([list(range(3, 103))], greedy(200), use_tqdm=False)
    h2o = tiny_llm(tiny1, "h2o:8,8", max_model_len=128)                  # original positions: bounded
    with pytest.raises(ValueError, match="lower max_tokens to at most 118"):
        h2o.generate([list(range(3, 13))], greedy(200), use_tqdm=False)
    out = llm.generate([list(range(3, 13))], greedy(200), use_tqdm=False)[0]   # 64 + 10 <= 128
    with pytest.raises(ValueError, match="cannot hold one sequence under kv_policy 'sinks:4,60'"):
        tiny_llm(tiny1, "sinks:4,60", blocks=16)                        # 64 slots: no room for one more token
    assert len(out.outputs[0].token_ids) == 200 and out.outputs[0].finish_reason == "length"


def test_recompute_preemption_with_eviction(tiny1):
    # two streams in a pool that holds one and a bit: preemption by recompute, then eviction again
    llm = tiny_llm(tiny1, "sinks:4,20", blocks=12, max_num_batched_tokens=8)
    oracle = Oracle(llm)
    outs = llm.generate([list(range(3, 11)), list(range(20, 28))], greedy(80), use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert all(len(o.outputs[0].token_ids) == 80 for o in outs)
    assert oracle.worst < 1e-4
    assert all_blocks_free(llm) and not llm.engine.evictor.states


def test_int8_cache_with_rerotation_stays_close(tiny1):
    # re-rotated keys go through read/write (dequantize, rotate, quantize); moves copy the raw int8 rows
    llm = tiny_llm(tiny1, "sinks:4,12", kv_cache_dtype="int8")
    oracle = Oracle(llm)
    llm.generate([list(range(3, 40))], greedy(30), use_tqdm=False)
    assert 0 < oracle.worst < 0.05, oracle.worst
    with pytest.raises(ValueError, match="KIVI"):
        LLM(tiny1, kv_cache_memory="1MiB", block_size=32, kv_policy="sinks:4,12", kv_cache_dtype="kivi4", dtype="float32")


# ---- scores, per-layer selection, freed blocks --------------------------------------------------------


def test_h2o_scores_equal_attention_from_a_math_path(tiny1, monkeypatch):
    llm = tiny_llm(tiny1, "h2o:100,100")
    eng = llm.engine
    prompt = list(range(5, 25))
    seen = []
    prepare = eng.runner.prepare

    def observed(scheduled):   # the step's forward reports each layer's q, k to `seen`
        inp = prepare(scheduled)
        inp.meta.observers = (lambda layer, q, k, v, scale, window: seen.append((q, k, scale)),)
        return inp

    monkeypatch.setattr(eng.runner, "prepare", observed)
    eng.add_request(prompt, greedy(2))
    eng.step()  # the prompt, one chunk
    (q, k, scale), = seen
    st = next(iter(eng.evictor.states.values()))
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * scale
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    probs = logits.masked_fill(~causal, -math.inf).softmax(-1)
    assert torch.allclose(st.scores[0][:20], probs.sum((0, 1)), atol=1e-5)
    while eng.has_unfinished_requests():
        eng.step()


def test_one_shot_compression_frees_blocks_and_keeps_entries_per_layer(tiny2):
    prompt = list(range(3, 40))              # 37 tokens: 10 blocks per layer
    ref = tiny_llm(tiny2, "full", max_num_batched_tokens=64)
    ref.engine.add_request(prompt, greedy(4), request_id="r")
    ref.engine.step()
    llm = tiny_llm(tiny2, "snapkv:16,6,1", max_num_batched_tokens=64)
    eng = llm.engine
    free0 = llm.get_metrics()["num_blocks_free"]
    eng.add_request(prompt, greedy(4), request_id="r")
    eng.step()                               # prefill the whole prompt, then evict to 16 per layer
    m = llm.get_metrics()
    assert free0 - m["num_blocks_free"] == 2 * 4
    assert m["kv_eviction_blocks_freed"] == 2 * (10 - 4) and m["kv_evicted_entries"] == 2 * (37 - 16)
    st = eng.evictor.states["r"]
    kept = [st.pos[g] for g in range(2)]
    assert all(len(k) == 16 for k in kept)
    assert set(range(37 - 6, 37)) <= set(kept[0].tolist()) and set(range(37 - 6, 37)) <= set(kept[1].tolist())
    assert kept[0].tolist() != kept[1].tolist()   # each layer keeps its own heavy hitters
    for g in range(2):                            # every kept entry holds exactly the reference K/V
        table = torch.tensor(eng.kv.block_ids("r", g))
        idx = torch.arange(16)
        got = eng.storage.read(g, table[idx // BS] * BS + idx % BS)
        rtable = torch.tensor(ref.engine.kv.block_ids("r", g))
        p = kept[g]
        want = ref.engine.storage.read(g, rtable[p // BS] * BS + p % BS)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    while eng.has_unfinished_requests():
        eng.step()
    assert all_blocks_free(llm)


def test_evicting_requests_read_the_prefix_cache_but_never_write_it(tiny1):
    prompt = list(range(3, 43))                                   # 40 tokens, 10 blocks
    params = lambda policy=None: greedy(6, logprobs=0, kv_policy=policy)  # noqa: E731
    # one prefill chunk, so streaming policies evict after the whole prompt with or without hits
    fresh = tiny_llm(tiny1, "full", enable_prefix_caching=False, max_num_batched_tokens=64)
    want = {p: fresh.generate([prompt], params(p), use_tqdm=False)[0] for p in
            (None, "snapkv:16,8", "sinks:4,12", "h2o:8,8")}
    llm = tiny_llm(tiny1, "full", max_num_batched_tokens=64)
    llm.generate([prompt], params("snapkv:16,8"), use_tqdm=False)
    assert llm.get_metrics()["num_blocks_cached"] == 0            # an evicting request publishes nothing
    first = llm.generate([prompt], params(), use_tqdm=False)[0]   # engine default: full cache, publishes
    assert first.num_cached_tokens == 0
    # hits: all blocks before SnapKV's 8-token observation window; any for sinks; none for H2O
    for policy, hits in (("snapkv:16,8", 32), ("sinks:4,12", 36), ("h2o:8,8", 0)):
        out = llm.generate([prompt], params(policy), use_tqdm=False)[0]
        assert out.num_cached_tokens == hits, policy
        assert out.outputs[0].token_ids == want[policy].outputs[0].token_ids
        lp = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        ref = [d[t].logprob for d, t in zip(want[policy].outputs[0].logprobs, want[policy].outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4, (policy, lp, ref)
    assert llm.get_metrics()["kv_eviction_blocks_unshared"] > 0  # hit blocks were copied, not compacted in place
    again = llm.generate([prompt], params(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 36                           # the cached blocks still hold the prompt
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == want[None].outputs[0].token_ids
    assert all_blocks_free(llm)


def test_bad_combinations_are_refused(tiny1, tmp_path):
    plain = LLM(tiny1, kv_cache_memory="1MiB", block_size=BS, dtype="float32")
    with pytest.raises(ValueError, match="engine started with a kv_policy"):
        plain.generate([[3, 4, 5]], greedy(2, kv_policy="window:8"), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_cache_mode"):
        LLM(tiny1, kv_cache_mode="none", kv_policy="window:8", dtype="float32")
    gemma = make_tiny_checkpoint("gemma3", tmp_path)      # 3 sliding layers (window 8) + 1 full layer
    g = LLM(gemma, kv_cache_memory="1MiB", block_size=BS, kv_policy="h2o:6,6", max_num_batched_tokens=8, dtype="float32")
    g.generate([list(range(3, 30))], greedy(20), use_tqdm=False)     # only the full layer evicts
    assert g.get_metrics()["kv_evicted_entries"] == 27 + 19 - 13   # the last step ends the request first
    assert all_blocks_free(g)


@pytest.mark.parametrize("recent", [8, 5])   # = and < the sliding window
def test_reindexing_on_a_hybrid_sliding_model_keeps_relative_positions(tmp_path, recent):
    """Gemma 3 layout (3 sliding layers, window 8, + 1 full layer). A recompute over the kept tokens is
    no oracle past one layer (deeper K/V remember evicted tokens), but RoPE is: scores depend only on
    query-key distance. `window:8` re-indexes every layer's keys (the full layer's by compaction, the
    sliding layers' by `_shift_sliding`); `h2o:0,8` keeps the same last 8 tokens at their original
    positions. Same distances everywhere, so the same logits; skipping the sliding layers' shift
    would change them. With a window below the sliding one, the sliding layers still see their own
    last 8 tokens, the oldest re-indexed below the full layer's first kept position: distances stay
    right (only differences of positions enter RoPE scores)."""
    gemma = make_tiny_checkpoint("gemma3", tmp_path, max_position_embeddings=64)
    prompts = [list(range(3, 30)), list(range(40, 52))]
    params = greedy(60, logprobs=0)
    runs = {}
    for policy in (f"window:{recent}", f"h2o:0,{recent}"):
        llm = LLM(gemma, kv_cache_memory="1MiB", block_size=BS, kv_policy=policy, max_num_batched_tokens=8,
                  max_model_len=200, dtype="float32")
        runs[policy] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_metrics()["kv_evicted_tokens"] > 0
        assert all_blocks_free(llm) and not llm.engine.evictor.states
    for a, b in zip(runs[f"window:{recent}"], runs[f"h2o:0,{recent}"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb
        lpa = [d[t].logprob for d, t in zip(a.outputs[0].logprobs, ta)]
        lpb = [d[t].logprob for d, t in zip(b.outputs[0].logprobs, tb)]
        assert max(abs(x - y) for x, y in zip(lpa, lpb)) < 1e-4


def test_reindexing_every_mla_layer_keeps_relative_positions(tmp_path):
    # three MLA layers (one dense, two MoE): `window:8` re-indexed == `h2o:0,8` at original positions
    ds = make_tiny_checkpoint("deepseek_v3", tmp_path, max_position_embeddings=64)
    runs = {}
    for policy in ("window:8", "h2o:0,8"):
        llm = LLM(ds, kv_cache_memory="1MiB", block_size=BS, kv_policy=policy, max_num_batched_tokens=8,
                  max_model_len=200, dtype="float32")
        runs[policy] = llm.generate([list(range(3, 30))], greedy(50, logprobs=0), use_tqdm=False)[0].outputs[0]
        assert llm.get_metrics()["kv_evicted_tokens"] > 0 and all_blocks_free(llm)
    a, b = runs["window:8"], runs["h2o:0,8"]
    assert a.token_ids == b.token_ids
    assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 1e-4


def test_sinks_stream_on_a_hybrid_sliding_model_runs_with_bounded_memory(tmp_path):
    gemma = make_tiny_checkpoint("gemma3", tmp_path, max_position_embeddings=64)
    llm = LLM(gemma, kv_cache_memory="1MiB", block_size=BS, kv_policy="sinks:2,10", max_num_batched_tokens=8,
              max_model_len=400, dtype="float32")
    peak = stream_peak_blocks(llm, list(range(3, 20)), 300)
    # full layer: 2 sinks + 10 recent + the new token; 3 sliding layers: 8 + the new token, each
    assert peak <= math.ceil(13 / BS) + 3 * (math.ceil(9 / BS) + 1)
    assert llm.get_metrics()["kv_evicted_tokens"] > 250
    assert all_blocks_free(llm)


# ---- the bundled model ---------------------------------------------------------------------------------


def test_per_layer_tables_are_transparent_on_the_bundled_model(llm):
    from helpers import assert_same_completions
    per_layer = LLM(kv_cache_memory="48MiB", max_model_len=1024, kv_policy="full", dtype="float32")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    assert_same_completions(per_layer.generate(prompts, params, use_tqdm=False),
                            llm.generate(prompts, params, use_tqdm=False))
    out = per_layer.generate(["Count: one two three four five six seven eight"],
                             greedy(40, kv_policy="sinks:4,12"), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 40
    assert per_layer.get_metrics()["kv_evicted_tokens"] > 0
    assert all_blocks_free(per_layer)


def test_bundled_model_streams_in_a_24mib_pool():
    """The bundled model (float32: 30 layers x 1,536 B per token and layer) under sinks:4,252: a 24 MiB
    pool (1,024 blocks = 34 per layer) now starts with max_model_len=4096 (prefill chunks shrink to
    288), and a 300-token stream runs past max_model_len=280 with its blocks bounded. The 1,200-token
    stream with an oracle runs on a tiny checkpoint
    (test_sinks_stream_runs_past_max_model_len_in_a_pool_of_its_bound): this model decodes ~8 tokens/s
    on 2 CPU cores."""
    big = LLM(kv_cache_memory="24MiB", max_model_len=4096, kv_policy="sinks:4,252", dtype="float32")
    assert big.engine.planner.prefill_chunk(big.engine.kv_policy) == 288
    del big
    llm = LLM(kv_cache_memory="24MiB", max_model_len=280, kv_policy="sinks:4,252", dtype="float32")
    eng = llm.engine
    rid = eng.add_request("Once upon a time", greedy(300))
    held = 0
    while eng.has_unfinished_requests():
        eng.step()
        held = max(held, eng.evictor.blocks_held(rid))
    assert held <= 30 * 256 // 16                    # 16 blocks per layer after every step
    assert llm.get_metrics()["kv_evicted_tokens"] > 40
    assert all_blocks_free(llm)


def test_cli_flags():
    from kvserve.cli import build_parser
    args = build_parser().parse_args(["generate", "hi", "--kv-policy", "sinks:4,1020"])
    assert args.kv_policy == "sinks:4,1020"
    args = build_parser().parse_args(["serve", "--kv-policy", "full"])
    assert args.kv_policy == "full"
    args = build_parser().parse_args(["eval", "kv-policy", "--budgets", "256,512", "--parts", "stream"])
    assert args.budgets == "256,512" and args.func.__module__ == "kvserve.tools.evaluate_policies"


# ---- the evaluation harness (kvserve eval kv-policy, benchmarks/kv_policies.py) ------------------------


def test_compression_eval_on_the_bundled_model():
    from kvserve.tools.evaluate_policies import PolicyEvalSettings, compression_eval, make_llm
    llm = make_llm(PolicyEvalSettings(), max_len=640)
    rows = compression_eval(llm, [512], [0.5], 1, kinds=("passkey",), seed=3, log=lambda line: None)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"full", "snapkv", "snapkv-qafter", "h2o", "sinks", "random"}
    assert by["full"]["accuracy"] == 1.0 and by["snapkv"]["accuracy"] == 1.0   # 512 tokens: easy
    assert all(r["cases"] == 1 and r["seeds"] == [3] for r in rows)
    for name in ("snapkv", "h2o", "sinks", "random"):   # half the prompt evicted: about half the blocks held
        assert 0.45 < by[name]["held_bytes"] / by[name]["full_bytes"] < 0.6, (name, by[name])
    assert all_blocks_free(llm)


def test_benchmark_merge_adds_cases_of_new_seeds_and_replaces_rerun_ones():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[1] / "benchmarks" / "kv_policies.py"
    spec = importlib.util.spec_from_file_location("kv_policies_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cell = dict(kind="passkey", length=1024, policy="h2o", evicted=0.5, held_bytes=10, full_bytes=20)
    old = {"rows": [{**cell, "accuracy": 1.0, "cases": 2}], "settings": {"lengths": [1024]}, "command": "a"}
    new = {"rows": [{**cell, "accuracy": 0.25, "cases": 4, "seeds": [1], "held_bytes": 12},
                    {**cell, "length": 4096, "accuracy": 0.5, "cases": 2, "seeds": [0]}],
           "settings": {"lengths": [1024, 4096]}, "command": "b"}
    merged = bench.merge_part(old, new)
    r1024, r4096 = sorted(merged["rows"], key=lambda r: r["length"])
    assert r1024["cases"] == 6 and r1024["accuracy"] == pytest.approx(0.5) and r1024["seeds"] == [0, 1]
    assert r1024["held_bytes"] == 12 and r4096["cases"] == 2
    assert merged["settings"]["lengths"] == [1024, 4096] and merged["commands"] == ["a", "b"]
    again = bench.merge_part(merged, {**new, "rows": [{**cell, "accuracy": 0.0, "cases": 4, "seeds": [1]}]})
    rerun = [r for r in again["rows"] if r["length"] == 1024][0]      # seed 1 again: its own cases replaced
    assert rerun["cases"] == 6 and rerun["accuracy"] == pytest.approx(2 / 6) and rerun["seeds"] == [0, 1]
