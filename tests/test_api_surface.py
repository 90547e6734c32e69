"""The rest of the OpenAI / vLLM request surface: logit_bias, allowed_token_ids and bad_words on
hand-computed logits and through the engine, and the priority scheduling order on a hand-worked
pool."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import Sampler, SamplingInput
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager


def _sample(logits, params, output=(), bad_words=()):
    inp = SamplingInput(params, [1], list(output), None, 1, [list(w) for w in bad_words])
    return Sampler([0], logits.shape[0])(logits.clone()[None], [inp])[0].token_ids[0]


def test_logit_bias_allowed_tokens_and_bad_words_move_the_greedy_choice():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    greedy = dict(temperature=0, max_tokens=4)
    assert _sample(logits, SamplingParams(**greedy)) == 1
    assert _sample(logits, SamplingParams(logit_bias={3: 2.5}, **greedy)) == 3      # 3 + 2.5 > 5
    assert _sample(logits, SamplingParams(logit_bias={1: -1.5}, **greedy)) == 2     # 5 - 1.5 < 4
    assert _sample(logits, SamplingParams(allowed_token_ids=[4, 5], **greedy)) == 4
    # a one-token bad word is never drawn; a two-token one only right after its first token
    assert _sample(logits, SamplingParams(**greedy), bad_words=[[1]]) == 2
    assert _sample(logits, SamplingParams(**greedy), output=[2], bad_words=[[2, 1]]) == 2
    assert _sample(logits, SamplingParams(**greedy), output=[3], bad_words=[[2, 1]]) == 1
    # reported log-probs stay the model's
    inp = SamplingInput(SamplingParams(logit_bias={3: 2.5}, logprobs=0, **greedy), [1], [], None)
    res = Sampler([0], 6)(logits.clone()[None], [inp])[0]
    assert res.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, 0)[3]))


@pytest.mark.parametrize("bad,why", [
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ({"logit_bias": {-1: 1}}, "logit_bias key must be a token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"bad_words": [" "]}, "bad_words must be a list of non-empty strings"),
    ({"priority": 1.5}, "priority must be an integer"),
])
def test_bad_token_filters_name_the_field(bad, why):
    with pytest.raises(ValueError, match=why):
        SamplingParams(**bad)


def test_token_filters_through_the_engine(llm):
    """allowed_token_ids keeps every drawn token in the set; a +100 bias makes a token the greedy
    choice at every step; a bad word taken from the free greedy output never appears in it again;
    ids outside the vocabulary and priority under fcfs are refused."""
    tok = llm.engine.tokenizer
    prompt = "The three most useful things to know about a KV cache are"
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    allowed = sorted(set(tok.encode(" the cache memory of a", add_special_tokens=False)))
    only = llm.generate(prompt, SamplingParams(allowed_token_ids=allowed, **greedy), use_tqdm=False)[0].outputs[0]
    assert set(only.token_ids) <= set(allowed)
    forced = llm.generate(prompt, SamplingParams(logit_bias={allowed[0]: 100}, **greedy), use_tqdm=False)[0]
    assert list(forced.outputs[0].token_ids) == [allowed[0]] * 12
    word = next(w for w in free.text.split() if w.isalpha() and len(w) > 3)
    banned = llm.generate(prompt, SamplingParams(bad_words=[word], **greedy), use_tqdm=False)[0].outputs[0]
    assert word not in banned.text.split() and word in free.text.split()
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt, SamplingParams(logit_bias={vocab: 1}), use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(prompt, SamplingParams(priority=1), use_tqdm=False)


def _manager(blocks: int) -> KVCacheManager:
    return KVCacheManager(blocks, 4, namespace_hash("test"), enable_prefix_caching=False)


def _request(rid: str, priority: int, arrival: float, tokens: int = 8) -> Request:
    return Request(rid, list(range(10, 10 + tokens)), SamplingParams(priority=priority), arrival_time=arrival)


def test_priority_order_admits_the_lowest_value_first_and_preempts_the_latest_in_that_order():
    """A pool of 6 blocks of 4 tokens, 8-token prompts (2 blocks each), one step of 16 tokens."""
    sched = Scheduler(_manager(6), max_num_seqs=8, max_num_batched_tokens=16, policy="priority")
    a, b, c = _request("a", 5, 0.0), _request("b", 1, 1.0), _request("c", 1, 2.0)
    for r in (a, b, c):
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["b", "c", "a"]   # priority, then arrival
    first = sched.schedule()
    assert [(r.request_id, n) for r, n in first.scheduled] == [("b", 8), ("c", 8)]   # the budget holds two
    for r, n in first.scheduled:
        r.num_computed_tokens += n
    second = sched.schedule()
    assert [(r.request_id, n) for r, n in second.scheduled] == [("a", 8)]
    a.num_computed_tokens += 8
    for r in (a, b, c):   # each decodes a token: b and c need a third block, and 6 are held already
        r.token_ids.append(1)
    third = sched.schedule()
    # b's third block evicts a (the latest in priority order), then c's fits in a's freed blocks
    assert [r.request_id for r in third.preempted] == ["a"]
    assert [(r.request_id, n) for r, n in third.scheduled] == [("b", 1), ("c", 1)]
    assert a.status == RequestStatus.PREEMPTED and list(sched.waiting) == [a] and a.num_computed_tokens == 0


def test_fcfs_order_keeps_arrival_order_whatever_the_priority():
    sched = Scheduler(_manager(6), max_num_seqs=8, max_num_batched_tokens=16)
    for r in (_request("a", 5, 0.0), _request("b", 1, 1.0)):
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
