"""Cached paged decode equals full recompute; the engine's bookkeeping stays whole."""

import pytest
from helpers import all_blocks_free, assert_same_completions

from kvserve import LLM, BeamSearchParams, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters. Every morning he",
    "Q: What is 12 times 12?\nA:",
    "List three colours:",
]
LONG = ("The KV cache stores the keys and values of every past token so that each decoding step "
        "only computes the new token's projections. ") * 6


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, **kw)


def test_mixed_batch_equals_recompute(llm, llm_nocache):
    out = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    ref = llm_nocache.generate(PROMPTS, greedy(), use_tqdm=False)
    assert_same_completions(out, ref)
    assert all_blocks_free(llm)


def test_chunked_prefill_equals_recompute(llm_nocache):
    small = LLM(kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=16, dtype="float32")
    prompts = [LONG, PROMPTS[2], PROMPTS[0]]
    out = small.generate(prompts, greedy(12), use_tqdm=False)
    ref = llm_nocache.generate(prompts, greedy(12), use_tqdm=False)
    assert_same_completions(out, ref)
    assert small.get_metrics()["num_steps"] > len(LONG) // 16 // 8  # the long prompt ran in chunks
    assert all_blocks_free(small)


def test_prefix_cache_hits_equal_recompute(llm, llm_nocache):
    llm.reset_prefix_cache()
    before = llm.get_metrics()
    first = llm.generate([LONG + "First question:"], greedy(), use_tqdm=False)
    second = llm.generate([LONG + "Second question:"], greedy(), use_tqdm=False)
    after = llm.get_metrics()
    assert first[0].num_cached_tokens == 0
    shared_blocks = len(llm.get_tokenizer().encode(LONG)) // 16  # whole blocks of the shared prefix
    assert second[0].num_cached_tokens >= (shared_blocks - 1) * 16
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == second[0].num_cached_tokens
    ref = llm_nocache.generate([LONG + "Second question:"], greedy(), use_tqdm=False)
    assert_same_completions(second, ref)


def test_identical_prompt_recomputes_last_token(llm):
    llm.reset_prefix_cache()
    ids = llm.get_tokenizer().encode(LONG)[:64]  # exactly 4 blocks of 16
    llm.generate([ids], greedy(4), use_tqdm=False)
    again = llm.generate([ids], greedy(4), use_tqdm=False)
    assert again[0].num_cached_tokens == 48  # the last block is not a hit: its last token is recomputed


def test_reset_prefix_cache(llm):
    llm.generate([LONG], greedy(2), use_tqdm=False)
    assert llm.reset_prefix_cache() > 0
    assert llm.get_metrics()["num_blocks_cached"] == 0
    assert llm.generate([LONG], greedy(2), use_tqdm=False)[0].num_cached_tokens == 0


def test_preemption_tiny_pool_changes_nothing(llm):
    """Requests preempted (and recomputed) in a tiny pool end as they do in a pool that holds them
    all (the shared engine: same model and dtype; cached decoding equals recompute in the tests above)."""
    # 28 blocks x 16 = 448 token slots for 8 requests of ~70 + 30 tokens: preemption must happen
    tiny = LLM(kv_cache_memory=28 * 16 * 46080, max_model_len=256, dtype="float32")
    prompts = [f"{PROMPTS[2]} ({i})" for i in range(8)]
    out = tiny.generate(prompts, greedy(30, ignore_eos=True), use_tqdm=False)
    before = llm.get_metrics()["num_preemptions"]
    ref = llm.generate(prompts, greedy(30, ignore_eos=True), use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] == before
    assert tiny.get_metrics()["num_preemptions"] > 0
    assert_same_completions(out, ref)
    assert all_blocks_free(tiny)


def test_parallel_sampling_forks_share_blocks(llm, llm_nocache):
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, logprobs=2)
    copies = llm.engine.kv.num_cow_copies
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    ref = llm_nocache.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert_same_completions(out, ref)
    assert llm.engine.kv.num_cow_copies - copies >= 2  # the shared partial block was copied on write
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    greedy_n = llm.generate([PROMPTS[0]], SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)
    single = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(c.token_ids == single[0].outputs[0].token_ids for c in greedy_n[0].outputs)
    assert all_blocks_free(llm)


def test_beam_search_equals_recompute(llm, llm_nocache):
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    out = llm.beam_search([PROMPTS[0]], params)[0]
    ref = llm_nocache.beam_search([PROMPTS[0]], params)[0]
    assert len(out.sequences) == 3
    for a, b in zip(out.sequences, ref.sequences):
        assert a.tokens == b.tokens
        assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-3)
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    assert all_blocks_free(llm)


def test_beam_width_one_is_greedy(llm):
    beam = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))[0]
    g = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert beam.sequences[0].tokens == g[0].outputs[0].token_ids


def test_contiguous_layout_equals_recompute_fewer_sequences(llm_nocache):
    contiguous = LLM(kv_cache_mode="contiguous", kv_cache_memory="64MiB", max_model_len=512, dtype="float32")
    out = contiguous.generate(PROMPTS, greedy(), use_tqdm=False)
    assert_same_completions(out, llm_nocache.generate(PROMPTS, greedy(), use_tqdm=False))
    m = contiguous.get_metrics()
    assert m["block_size"] == 512  # one reserved max_model_len slab per sequence
    assert m["num_blocks_total"] == (64 << 20) // (512 * 46080)


def test_seeded_sampling_reproducible_across_batches(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    alone = llm.generate([PROMPTS[3]], p, use_tqdm=False)
    mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                         [SamplingParams(temperature=1.0, max_tokens=10), p, greedy()], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids


def test_prompt_logprobs_match_recompute(llm, llm_nocache):
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    a = llm.generate([PROMPTS[2]], p, use_tqdm=False)[0]
    b = llm_nocache.generate([PROMPTS[2]], p, use_tqdm=False)[0]
    assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(a.prompt_token_ids)
    for i, (x, y) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), start=1):
        tok = a.prompt_token_ids[i]
        assert tok in x and abs(x[tok].logprob - y[tok].logprob) < 1e-4


def test_stop_strings_and_tokens(llm):
    base = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    word = base.text.strip().split()[0]
    cut = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16, stop=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == base.text[:base.text.index(word)]
    tok = base.token_ids[2]
    by_id = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tok]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == base.token_ids[:base.token_ids.index(tok) + 1] and by_id.stop_reason == tok


def test_metrics_count_tokens_and_blocks(llm):
    before = llm.get_metrics()
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    after = llm.get_metrics()
    assert after["generation_tokens"] - before["generation_tokens"] == 10
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in out)
    assert after["num_blocks_used"] == 0 and after["kv_cache_usage"] == 0.0
    assert after["kv_cache_bytes"] == after["num_blocks_total"] * 16 * llm.kv_bytes_per_token
    assert after["ttft_p50"] is not None and after["tpot_p50"] is not None
