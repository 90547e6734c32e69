"""Speculative decoding with a draft model (method draft_model) on tiny random-weight checkpoints
that share a vocabulary: the draft a copy of the target (every proposal accepted) and a mismatched
one (few accepted); greedy output always equals the engine without speculation, and both KV pools
are free once the requests end."""

import pytest
from family_checkpoints import make_tiny_checkpoint, tiny_model
from helpers import all_blocks_free

from kvserve import LLM, SamplingParams
from kvserve.engine.spec import parse_speculative_config
from kvserve.engine.spec.draft import Mirror

BASE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12] * 5, [3] * 20, list(range(30, 70))]


def greedy(max_tokens=30):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def draft_spec(model, k=4, **extra):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


def draft_pool(llm):
    """The draft's KV pool."""
    return llm.engine.speculator.proposer.kv.pool


def draft_free(llm) -> bool:
    pool = draft_pool(llm)
    return pool.num_free == pool.num_usable and not llm.engine.speculator.proposer.mirrors


def save_tiny(folder, seed=0, **overrides) -> str:
    """A tiny llama checkpoint of `seed` (make_tiny_checkpoint's shapes, vocabulary of 256)."""
    tiny_model("llama", seed=seed, **overrides).save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, **BASE)


def outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- the mirror's rollback, by hand ---------------------------------------------------------------
def test_mirror_keeps_the_accepted_proposals_and_rolls_back_the_rest():
    class Req:
        request_id = "r"
    m = Mirror(Req())
    assert m.sync([1, 2, 3]) == 0
    m.token_ids += [7, 8, 9]                            # catch-up and two steps: proposals 7, 8, 9
    m.num_computed_tokens = 5                           # 1 2 3 7 8 computed
    assert m.sync([1, 2, 3, 7, 4]) == 4                 # 7 accepted, then the target's own 4
    assert m.token_ids == [1, 2, 3, 7, 4]
    m.token_ids += [5, 6]
    m.num_computed_tokens = 6                           # 4 and 5 computed
    assert m.sync([1, 2, 3, 7, 4, 5, 6, 1]) == 6        # all accepted: the last proposal and the bonus run
    assert m.sync([1, 2, 3, 7, 4, 5, 6, 1]) == 6        # no new token: the last one still runs again
    assert m.token_ids == [1, 2, 3, 7, 4, 5, 6, 1] and m.proposed == []


# ---- the engine: greedy output equals the engine without speculation ------------------------------
def test_draft_equal_to_the_target_gets_every_proposal_accepted(target, plain):
    expected = outputs(plain, PROMPTS, greedy())
    spec = LLM(target, **BASE, speculative_config=draft_spec(target))
    assert outputs(spec, PROMPTS, greedy()) == expected
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]
    assert all_blocks_free(spec) and draft_free(spec)
    # the KV budget holds both pools: the draft's 1/8 of it comes out of the target's
    pool = draft_pool(spec)
    assert spec.engine.kv.num_blocks + pool.num_usable == plain.engine.kv.num_blocks


def test_mismatched_draft_is_rarely_accepted_and_changes_nothing(target, plain, tmp_path):
    other = save_tiny(tmp_path / "other", seed=7, num_hidden_layers=1)
    expected = outputs(plain, PROMPTS, greedy())
    spec = LLM(target, **BASE, speculative_config=draft_spec(other))
    assert outputs(spec, PROMPTS, greedy()) == expected
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] < 0.3 * m["spec_decode_num_draft_tokens"]
    assert all_blocks_free(spec) and draft_free(spec)


def test_proposals_are_the_drafts_greedy_continuation_after_rollbacks(target, plain):
    """A sampled target rejects some of its own greedy proposals: after each rollback the draft
    still proposes exactly the greedy continuation of the accepted tokens (its KV holds them)."""
    spec = LLM(target, **BASE, speculative_config=draft_spec(target))
    proposer = spec.engine.speculator.proposer
    calls, propose = [], proposer.propose

    def recording(reqs, ks):
        out = propose(reqs, ks)
        calls.extend((list(r.token_ids), k, p) for r, k, p in zip(reqs, ks, out))
        return out
    proposer.propose = recording
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    spec.generate(PROMPTS[:2], sampled, use_tqdm=False)
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]   # rejections happened
    for tokens, k, proposed in calls:
        assert proposed == outputs(plain, [tokens], greedy(k))[0]
    assert all_blocks_free(spec) and draft_free(spec)


def test_batch_with_preemption_abort_and_a_short_draft_pool(target, plain):
    """Four requests of different lengths in a target pool too small for them (preemption) and a
    draft pool that holds one sequence of max_model_len (some get no proposals); one is aborted
    mid-way. The rest end as without speculation and both pools come back whole."""
    block = 16 * 512                                   # 16 tokens x 512 B/token (2 layers, 2 KV heads of 16)
    spec = LLM(target, dtype="float32", max_model_len=128, kv_cache_memory=(9 + 8) * block,
               speculative_config=draft_spec(target, draft_kv_cache_memory=8 * block, disable_by_batch_size=None))
    assert spec.engine.kv.num_blocks == 9 and draft_pool(spec).num_usable == 8
    engine = spec.engine
    params = greedy(40)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:
            assert engine.abort_request(ids[1]).outputs[0].token_ids   # mid-way: some tokens, not all
    expected = outputs(plain, PROMPTS, params)
    assert ids[1] not in done
    assert [done[i] for i in ids if i != ids[1]] == [e for i, e in zip(ids, expected) if i != ids[1]]
    m = spec.get_metrics()
    assert m["num_preemptions"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    assert engine.speculator.proposer.num_short > 0
    assert all_blocks_free(spec) and draft_free(spec)


# ---- start-up errors -------------------------------------------------------------------------------
def _tokenizer(folder, words: list[str]) -> None:
    """A word-level tokenizer of `words` (one id each) saved into `folder`."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(str(folder))


def test_a_draft_with_another_vocabulary_size_is_refused(target, tmp_path):
    bigger = save_tiny(tmp_path / "bigger", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        LLM(target, **BASE, speculative_config=draft_spec(bigger))


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    words = [f"w{i}" for i in range(256)]
    tgt, same, other = (save_tiny(tmp_path / name) for name in ("t", "same", "other"))
    _tokenizer(tgt, words)
    _tokenizer(same, words)
    _tokenizer(other, words[::-1])
    LLM(tgt, **BASE, speculative_config=draft_spec(same))   # the same tokens: accepted
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        LLM(tgt, **BASE, speculative_config=draft_spec(other))


@pytest.mark.parametrize("spec, message", [
    (dict(model="/nonexistent/draft.gguf"), "does not exist"),
    (dict(draft_kv_cache_memory="16MiB"), "leaves the target nothing"),
    (dict(draft_kv_cache_memory=4096), "draft model's KV pool"),
])
def test_startup_errors_say_what_to_do(target, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(target, **BASE, speculative_config=draft_spec(spec.pop("model", target), **spec))


def test_a_draft_with_a_shorter_context_is_refused(target, tmp_path):
    short = save_tiny(tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ValueError, match="draft model .*context length 128"):
        LLM(target, **BASE, speculative_config=draft_spec(short))


def test_draft_kv_cache_memory_is_only_for_a_draft_model():
    with pytest.raises(ValueError, match="only method 'draft_model'"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "draft_kv_cache_memory": "1GiB"})
    with pytest.raises(ValueError, match="must be > 0"):
        parse_speculative_config(draft_spec("x", draft_kv_cache_memory=0))
