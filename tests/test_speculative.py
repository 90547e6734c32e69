"""Speculative decoding: proposers on hand-made sequences, the verdict's distribution against the
target's, the KV rollback against the pool's own hashes, and greedy output against the same engine
without speculation (the oracle)."""

import math

import pytest
import torch
from helpers import all_blocks_free
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.options import engine_options
from kvserve.engine.sampler import Sampler, SamplingInput
from kvserve.engine.spec import num_accepted, parse_speculative_config
from kvserve.engine.spec.ngram import NgramIndex
from kvserve.engine.spec.suffix import GrowingTree, SuffixProposer, SuffixTree, best_path
from kvserve.kv.hashing import hash_full_blocks
from kvserve.kv.manager import KVCacheManager

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
PROMPTS = [
    "Copy this code exactly, renaming area to surface:\n" + CODE + "\nThe copy:\n",
    "Quote the first sentence of this text twice. Text: The KV cache stores keys and values of past "
    "tokens so decoding does not recompute them. Quotes:",
    "The capital of France is",
    "List the numbers from one to twenty separated by commas:",
]


def greedy(max_tokens=48):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


# ---- proposers, by hand ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    index.extend(tokens)
    assert index.propose(tokens, 3) == [5, 7, 1]        # [1, 2, 3] last seen before at 5..7
    assert index.propose(tokens + [8], 2) == []         # [3, 8] and [2, 3, 8] never seen
    index.extend(tokens + [5])
    assert index.propose(tokens + [5], 2) == [7, 1]     # [2, 3, 5] -> 7, 1
    assert NgramIndex(2, 3).propose([4, 4], 2) == []    # nothing indexed yet


def test_suffix_tree_counts_and_the_likeliest_path():
    tree = SuffixTree(depth=4)
    tree.add([1, 2, 3])
    tree.add([1, 2, 4])
    tree.add([1, 2, 3])
    node, n = tree.match([7, 1, 2])
    assert n == 2 and node.count == 3                   # "1 2" occurred three times
    assert {t: c.count for t, c in node.children.items()} == {3: 2, 4: 1}
    path, score = best_path(node, limit=3, min_prob=0.5)
    assert path == [3] and score == pytest.approx(2 / 3)
    assert best_path(node, limit=3, min_prob=0.7)[0] == []   # 2/3 < 0.7: not proposed
    tree.add([1, 2, 3], delta=-1)
    tree.add([1, 2, 3], delta=-1)
    node, _ = tree.match([1, 2])
    assert {t: c.count for t, c in node.children.items()} == {4: 1}


def test_growing_tree_equals_the_tree_of_the_whole_sequence():
    tokens = [5, 1, 2, 5, 1, 3, 5, 1, 2, 2, 5]
    grown = GrowingTree(depth=3)
    for end in range(1, len(tokens) + 1):
        grown.extend(tokens[:end])
    whole = SuffixTree(depth=3)
    whole.add(tokens)

    def counts(node, prefix=()):
        out = {}
        for t, c in node.children.items():
            out[prefix + (t,)] = c.count
            out.update(counts(c, prefix + (t,)))
        return out
    assert counts(grown.root) == counts(whole.root)
    node, n = grown.match(tokens)
    assert n == 2 and set(node.children) == {1}         # "... 5" -> "2 5" has a continuation: 1


def test_suffix_proposer_learns_from_finished_outputs():
    class Req:
        def __init__(self, rid, tokens, output):
            self.request_id, self.token_ids, self.output_token_ids = rid, tokens, output
    proposer = SuffixProposer(depth=8, max_cached=1, spec_factor=2.0, min_prob=0.1)
    proposer.finished(Req("a", [0, 10, 11, 12, 13, 14], [10, 11, 12, 13, 14]))
    assert proposer.propose([Req("b", [0, 1, 10, 11], [])], [3]) == [[12, 13, 14]]
    proposer.finished(Req("c", [0, 20], [20]))          # only one output is kept: "a" leaves
    assert proposer.propose([Req("d", [0, 1, 10, 11], [])], [3]) == [[]]


def test_num_accepted_stops_at_the_first_mismatch():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0


def test_allowance_follows_acceptance_and_rejections_pause_proposals():
    """k grows after a fully accepted verdict, shrinks to one more than accepted otherwise; a verdict
    accepting nothing pauses the request's proposals for 1, then 2, 4 ... steps, until one accepts."""
    from types import SimpleNamespace

    from kvserve.engine.spec import SpeculativeConfig, Speculator
    from kvserve.outputs import RequestMetrics

    class Always:
        def propose(self, reqs, ks):
            return [[1] * k for k in ks]

        def finished(self, req):
            pass
    spec = Speculator(SpeculativeConfig("ngram", 4), Always(), max_model_len=1000)
    req = SimpleNamespace(request_id="r", grammar=None, is_finished=False, num_tokens=10, num_computed_tokens=9,
                          num_output_tokens=2, params=SimpleNamespace(max_tokens=100), spec_token_ids=[],
                          metrics=RequestMetrics(0.0))

    def step(accepted=None):
        spec.propose([req])
        k = len(req.spec_token_ids)
        if k and accepted is not None:
            spec.verdict(req, [1] * min(accepted, k) + [2] * (k + 1 - min(accepted, k)))
        return k
    assert step(1) == 4            # 1 of 4 accepted: next allowance 2
    assert step(2) == 2            # all accepted: 3
    assert step(0) == 3            # none accepted: a pause of 1 step
    assert step() == 0
    assert step(0) == 1            # none again: pause 2
    assert [step(), step()] == [0, 0]
    assert step(1) == 1            # accepted: no pause, allowance 2
    assert step() == 2
    assert req.metrics.spec_acceptance_rate == pytest.approx(4 / 11)   # drafted 4+2+3+1+1, accepted 1+2+0+0+1


# ---- the verdict draws from the target's distribution --------------------------------------------
def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_verdict_keeps_the_target_distribution():
    """Rows sampled as if the drafts before them were accepted, accepted while equal: the first
    emitted token is distributed as p0 and the second (after an accepted draft) as p1, and the
    draft is accepted with probability p0(draft) (chi-square, 4 tokens: 3 degrees of freedom)."""
    p0 = torch.tensor([0.5, 0.2, 0.2, 0.1])
    p1 = torch.tensor([0.1, 0.6, 0.1, 0.2])
    logits = torch.stack([p0.log(), p1.log()])
    sampler = Sampler([], 4, seed=0)
    params = SamplingParams(temperature=1.0)
    draft, trials = 0, 4000
    first, second, accepted = [0] * 4, [0] * 4, 0
    for seed in range(trials):
        gen = torch.Generator().manual_seed(seed)
        rows = [SamplingInput(params, [1], [], gen), SamplingInput(params, [1], [draft], gen)]
        drawn = [r.token_ids[0] for r in sampler(logits, rows)]
        n = num_accepted([draft], drawn)
        first[drawn[0]] += 1
        if n:
            accepted += 1
            second[drawn[1]] += 1
    assert _chi_square(first, p0.tolist()) < 16.3       # p = 0.001 at 3 degrees of freedom
    assert _chi_square(second, p1.tolist()) < 16.3
    assert abs(accepted / trials - p0[draft].item()) < 4 * math.sqrt(0.25 / trials)


# ---- the KV cache: rollback and hashes ------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=30))
def test_rollback_registers_only_accepted_blocks(verdicts):
    """A request that speculates k tokens a step and keeps a of them: its table never holds more
    blocks than its tokens need after the verdict (nor fewer than its computed tokens'), every hash in the pool names accepted tokens,
    and freeing it frees every block."""
    bs = 4
    kv = KVCacheManager(64, bs, b"ns")
    tokens = [7, 8, 9]
    kv.allocate_slots("r", 0, len(tokens))
    computed = len(tokens) - 1          # as after a prefill: the last token waits for its step
    kv.cache_blocks("r", tokens, computed)
    for k, a in verdicts:
        a = min(a, k)
        if not kv.allocate_slots("r", computed, 1 + k):
            break
        computed += 1                       # its own token's K/V
        tokens += [100 + len(tokens) + i for i in range(a + 1)]   # a accepted drafts + the bonus token
        computed += a
        kv.trim("r", len(tokens))
        kv.cache_blocks("r", tokens, computed)
        held = len(kv.block_ids("r"))   # the computed tokens' blocks, at most the bonus token's more
        assert kv.blocks_for_tokens(computed) <= held <= kv.blocks_for_tokens(len(tokens))
    accepted = set(hash_full_blocks(b"ns", tokens[:computed], bs))
    assert set(kv.pool.cached) <= accepted
    kv.free("r")
    assert kv.pool.num_free == kv.pool.num_usable


# ---- options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not JSON"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "promt_lookup_max": 3}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
])
def test_bad_speculative_config_is_refused_clearly(value, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(value)


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_mode="none"), "kv_cache_mode='none'"),
    (dict(kv_policy="window:64"), "kv_policy"),
    (dict(kv_cache_dtype="kivi4"), "kivi4"),
])
def test_unsupported_combinations_are_refused_before_loading(options, message):
    config = EngineConfig(speculative_config=NGRAM, **options)
    with pytest.raises(ValueError, match=message):
        engine_options(config)


def test_speculative_config_reads_json_as_the_flag_gives_it():
    config = engine_options(EngineConfig(speculative_config='{"method": "suffix", "num_speculative_tokens": 3}'))
    assert config.speculative_config.method == "suffix"
    assert config.speculative_config.num_speculative_tokens == 3


# ---- the engine: greedy output equals the engine without speculation ------------------------------
@pytest.fixture(scope="module")
def expected(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.mark.parametrize("method", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_output_equals_the_engine_without_speculation(method, expected, llm):
    spec = LLM(kv_cache_memory="128MiB", max_model_len=2048, dtype="float32", speculative_config=method)
    first = spec.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0 and m["spec_decode_num_drafts"] > 0
    assert sum(m["spec_decode_num_accepted_tokens_per_pos"]) == m["spec_decode_num_accepted_tokens"]
    assert m["spec_decode_num_accepted_tokens"] <= m["spec_decode_num_draft_tokens"]
    assert 0 < first[0].metrics.spec_accepted_tokens <= first[0].metrics.spec_draft_tokens   # it copies some
    assert all_blocks_free(spec)
    _assert_hashes_name_outputs(spec, first)
    _assert_exported(m)
    # again: the prompts hit the prefix cache (and their outputs' accepted blocks), same tokens
    again = spec.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again[:2])
    # n > 1 (greedy forks) equal the greedy output; a seeded sampled request draws once per token
    # whatever was proposed: the same tokens as the engine without speculation
    forks = spec.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in forks.outputs] == [expected[0], expected[0]]
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=32)
    runs = [e.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids for e in (spec, spec, llm)]
    assert runs[0] == runs[1] == runs[2]
    assert all_blocks_free(spec)


def test_default_configuration_one_stream_equals_the_engine_without_speculation():
    """weights=auto (the GGUF's int4 groups), bfloat16 K/V: a step verifying 4 proposals runs the
    same kernels per row as a one-row decode step (the int4 GEMV up to 5 rows, the decode attention
    kernel), so each request alone decodes the same tokens with and without speculation."""
    plain, spec = LLM(), LLM(speculative_config=NGRAM)
    for prompt in PROMPTS:
        want = plain.generate(prompt, greedy(64), use_tqdm=False)[0].outputs[0].token_ids
        assert spec.generate(prompt, greedy(64), use_tqdm=False)[0].outputs[0].token_ids == want
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert all_blocks_free(spec)


def _assert_hashes_name_outputs(spec, outputs) -> None:
    """Every block hash in the pool is a hash of a prefix some request really had (prompt + output)."""
    kv = spec.engine.kv
    real = set()
    for o in outputs:
        real.update(hash_full_blocks(kv.namespace, o.prompt_token_ids + o.outputs[0].token_ids,
                                     kv.block_size, algo=kv.hash_algo))
    assert kv.pool.cached and set(kv.pool.cached) <= real


def _assert_exported(m: dict) -> None:
    """Prometheus carries the counters under kvserve: and (--metrics-names vllm) vLLM's names."""
    from kvserve.server.metrics import ServerMetrics
    metrics = ServerMetrics("m", 2048)
    metrics.export_vllm_names()
    text = metrics.render(m).decode()
    for prefix in ("kvserve:", "vllm:"):
        assert f'{prefix}spec_decode_num_accepted_tokens_total{{model_name="m"}} ' \
               f'{float(m["spec_decode_num_accepted_tokens"])}' in text
        assert f'{prefix}spec_decode_num_draft_tokens_total{{model_name="m"}}' in text
        assert f'{prefix}spec_decode_num_drafts_total{{model_name="m"}}' in text
        first = m["spec_decode_num_accepted_tokens_per_pos"][0]
        assert f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} ' \
               f'{float(first)}' in text


def test_preempted_speculating_requests_end_as_without_speculation(llm):
    """A pool too small for the batch: requests are preempted (their proposals dropped) and
    recomputed; tokens equal the unconstrained engine's and every block comes back."""
    prompts = PROMPTS[:2] * 3   # 6 requests of 5-9 blocks each at the end, in 20 blocks
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(40), use_tqdm=False)]
    tiny = LLM(kv_cache_memory=20 * 16 * 46080, max_model_len=256, dtype="float32",
               speculative_config=dict(NGRAM, disable_by_batch_size=None))
    out = tiny.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    m = tiny.get_metrics()
    assert m["num_preemptions"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    assert all_blocks_free(tiny)


def test_speculation_stops_above_disable_by_batch_size(llm, expected):
    spec = LLM(kv_cache_memory="128MiB", max_model_len=2048, dtype="float32",
               speculative_config=dict(NGRAM, disable_by_batch_size=2))
    out = spec.generate(PROMPTS, greedy(), use_tqdm=False)   # 4 sequences run: no proposals until 2 are left
    assert [o.outputs[0].token_ids for o in out] == expected
    lone = spec.get_metrics()["spec_decode_num_drafts"]
    spec.generate(PROMPTS[0], greedy(), use_tqdm=False)
    assert spec.get_metrics()["spec_decode_num_drafts"] > lone   # alone it speculates


def test_sliding_window_model_speculates_like_it_decodes(tmp_path):
    """A Mistral-shaped checkpoint with an 8-token window (random weights): a repeating prompt, so
    proposals are made and accepted, runs past the window with the same tokens as without."""
    from family_checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint("mistral", tmp_path)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    ref = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
               speculative_config=dict(NGRAM, prompt_lookup_min=1))
    out = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    assert spec.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert all_blocks_free(spec)


def test_a_speculating_request_whose_logits_turn_nan_fails_alone(expected, monkeypatch):
    """A NaN row among a speculating request's rows fails that request only (the rows of the others
    are sampled again); the others end as without speculation and every block comes back."""
    from helpers import PoisonedSampler
    spec = LLM(kv_cache_memory="128MiB", max_model_len=2048, dtype="float32", speculative_config=NGRAM)
    monkeypatch.setattr(spec.engine, "sampler", PoisonedSampler(spec.engine.sampler))
    params = [greedy(), SamplingParams(temperature=0, max_tokens=48, seed=1010), greedy()]
    fine, failed, other = spec.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "abort" and "NaN or infinite" in failed.error
    assert len(failed.outputs[0].token_ids) <= 10
    assert [fine.outputs[0].token_ids, other.outputs[0].token_ids] == [expected[0], expected[2]]
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert all_blocks_free(spec)
