"""The batch-invariant mode (batch_invariant=True): a request's greedy tokens, and their logprobs bit
for bit, are those it gets alone, whatever shares its steps, however its prompt is chunked, whether
its prefix is computed, found in the prefix cache or loaded from a tier, and across preemption.

The oracle is the request run alone on the same engine. The default mode gives no such promise
(docs/SERVING.md "Batch invariance"); tests/test_cpu_gemv.py and test_kernels_by_rows.py show the
kernels it swaps out giving a lone row other bits."""

import dataclasses

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.options import engine_options

MAX_TOKENS = 20
TEXT = ("The KV cache keeps the keys and values of every past token so that a decode step reads them "
        "instead of recomputing them. ")


def prompts() -> list[str]:
    """Six prompts of 25 to 320 tokens (several prefill chunks of a 64-token step budget)."""
    return [f"Story {i}: " + TEXT * reps + "In short," for i, reps in enumerate((1, 3, 6, 9, 12, 2))]


def greedy(logprobs: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1 if logprobs else None)


def results(outputs) -> list[tuple[list[int], list[float]]]:
    """Per request: its tokens and each token's logprob (exact floats)."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        out.append((c.token_ids, [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]))
    return out


@pytest.fixture(scope="module")
def engine():
    """The bundled model in its default formats (GGUF weights, bfloat16 K/V) under a pool that holds
    any one request but not all six (so the batch preempts), a 64-token step budget (prompts are
    chunked, chunks share steps with decodes) and a CPU tier below the prefix cache."""
    return LLM(batch_invariant=True, kv_cache_memory="12MiB", max_model_len=512, max_num_batched_tokens=64,
               kv_tiers=["cpu:64MiB"])


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt run on its own, the prefix cache emptied before each."""
    out = []
    for p in prompts():
        engine.reset_prefix_cache()
        out += results(engine.generate([p], greedy(), use_tqdm=False))
    return out


def test_the_mode_runs_its_kernels(engine):
    runner = engine.engine.runner
    assert set(runner.backend_names()) == {"InvariantBackend"}
    assert not engine.engine.compiled and runner.captured is None
    from kvserve.model.quant import quant_layers
    layers = quant_layers(engine.engine.model)
    assert layers and all(m.invariant and m.bf16_t is None for m in layers)


def test_a_batch_that_chunks_and_preempts_gives_each_request_its_alone_bits(engine, alone):
    engine.reset_prefix_cache()
    before = engine.engine.scheduler.num_preemptions
    together = results(engine.generate(prompts(), greedy(), use_tqdm=False))
    assert engine.engine.scheduler.num_preemptions > before   # the pool cannot hold all six
    assert together == alone


def test_a_prefix_from_the_cache_or_the_tier_gives_the_same_bits(engine, alone):
    engine.reset_prefix_cache()
    engine.generate(prompts()[3:4], greedy(False), use_tqdm=False)       # the prompt's blocks now cached
    cached = engine.generate(prompts()[3:4], greedy(), use_tqdm=False)
    assert cached[0].num_cached_tokens > 0
    assert results(cached) == alone[3:4]
    engine.reset_prefix_cache(offload=True)        # the device forgets, its blocks written down to the CPU tier
    tiered = engine.generate(prompts()[3:4], greedy(), use_tqdm=False)
    assert tiered[0].num_cached_tokens > 0
    assert results(tiered) == alone[3:4]


def test_sampled_rows_beside_greedy_ones_leave_them_alone(engine, alone):
    """Sampling requests in the same steps: the greedy ones keep their bits."""
    engine.reset_prefix_cache()
    params = [greedy() if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS)
              for i in range(6)]
    out = engine.generate(prompts(), params, use_tqdm=False)
    assert results(out[0::2]) == alone[0::2]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in out[1::2])


def test_speculative_decoding_keeps_the_bits(engine, alone):
    """ngram speculation on another engine in the mode: the proposals are verified on the same
    kernels, so every request (repetitive prompts: many proposals accepted) gets its alone bits."""
    spec = LLM(batch_invariant=True, kv_cache_memory="12MiB", max_model_len=512, max_num_batched_tokens=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = spec.generate(prompts(), greedy(), use_tqdm=False)
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert results(out) == alone


def test_sliding_window_layers_are_invariant_too(tmp_path):
    """Gemma-3's hybrid layers (window 8) on a tiny random checkpoint, float32 weights: token-id
    prompts alone and together."""
    from family_checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint("gemma3", tmp_path)
    llm = LLM(model=path, batch_invariant=True, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=24)
    ids = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((9, 40, 70, 17))]
    single = []
    for p in ids:
        llm.reset_prefix_cache()
        single += results(llm.generate([{"prompt_token_ids": p}], greedy(), use_tqdm=False))
    llm.reset_prefix_cache()
    together = results(llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False))
    assert together == single


@pytest.mark.parametrize("change,message", [
    ({"kv_cache_mode": "none"}, "needs a KV cache"),
    ({"kv_policy": "window:64"}, "kv_policy"),
    ({"attention_backend": "torch"}, "attention_backend"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"dtype": "float16"}, "float32 or bfloat16"),
    ({"device": "cuda"}, "runs on CPU"),
])
def test_what_the_mode_cannot_run_with_is_refused_before_loading(change, message):
    config = dataclasses.replace(EngineConfig(batch_invariant=True), **change)
    with pytest.raises(ValueError, match=message):
        engine_options(config)
