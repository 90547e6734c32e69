"""Structured outputs: every constrained output is a sentence of its grammar (checked with a fresh
xgrammar matcher, the grammar engine's own, and with json / jsonschema / re), greedy output is the
argmax over the tokens the grammar allows at each position (teacher-forced logits), unconstrained
requests in the same batch are untouched, and a constraint that cannot compile is refused with
nothing lost."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch
import xgrammar as xgr
from helpers import all_blocks_free

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.grammar import apply_bitmask, new_bitmask
from kvserve.tools.evaluate import run_forced

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
          "required": ["name", "age"]}


def _matcher(llm, params: StructuredOutputsParams):
    return xgr.GrammarMatcher(llm.engine.structured.compiler.compile(params))


def _is_sentence(llm, params: StructuredOutputsParams, tokens: list[int]) -> bool:
    """A fresh matcher accepts every token and ends at the grammar's end (its stop token included)."""
    m = _matcher(llm, params)
    return all(m.accept_token(t) for t in tokens) and m.is_terminated()


def test_json_schema_output_follows_the_schema_and_is_the_masked_argmax(llm):
    params = StructuredOutputsParams(json=PERSON)
    prompt = "Describe a famous scientist as JSON with name, age and tags:"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=120, structured_outputs=params),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    tokens = list(out.token_ids)
    assert _is_sentence(llm, params, tokens)
    # the oracle: teacher-forced logits of the same tokens, masked by a fresh matcher, argmax
    ids = llm.engine.tokenizer.encode(prompt)
    (logits,), _ = run_forced(llm, [(ids, tokens)], [])
    m, mask = _matcher(llm, params), new_bitmask(1, llm.engine.model_config.vocab_size)
    for i, tok in enumerate(tokens):
        m.fill_next_token_bitmask(mask, 0)
        allowed = apply_bitmask(logits[i:i + 1, :mask.shape[1] * 32].clone(), mask)
        assert int(allowed.argmax()) == tok, i
        m.accept_token(tok)


def test_regex_choice_grammar_and_json_object_in_one_batch_with_an_unconstrained_request(llm):
    greedy = dict(temperature=0, max_tokens=40)
    cases = [
        (StructuredOutputsParams(regex=r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"), "Write an email address:"),
        (StructuredOutputsParams(choice=["Paris", "London", "Rome"]), "The capital of France is"),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ " + " [0-9]+ ")"'), "A sum:"),
        (StructuredOutputsParams(json_object=True), "A JSON object describing a cat:"),
    ]
    free = ("The three most useful things to know about a KV cache are", SamplingParams(**greedy))
    alone = llm.generate(free[0], free[1], use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([p for _, p in cases] + [free[0]],
                        [SamplingParams(structured_outputs=c, **greedy) for c, _ in cases] + [free[1]],
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(cases[0][0].regex, texts[0]), texts[0]
    assert texts[1] in cases[1][0].choice
    assert re.fullmatch(r"\(\d+ \+ \d+\)", texts[2]), texts[2]
    for (c, _), o in zip(cases[:3], outs):
        assert o.outputs[0].finish_reason == "stop" and _is_sentence(llm, c, list(o.outputs[0].token_ids))
    # any JSON object: a whole one when it stopped, else the start of one that ran out of tokens
    obj = outs[3].outputs[0]
    m = _matcher(llm, cases[3][0])
    assert all(m.accept_token(t) for t in obj.token_ids) and texts[3].startswith("{")
    if obj.finish_reason == "stop":
        assert m.is_terminated() and isinstance(json.loads(texts[3]), dict)
    else:
        assert len(obj.token_ids) == greedy["max_tokens"] and not m.is_terminated()
    assert outs[-1].outputs[0].token_ids == alone   # the unconstrained row is as if it ran alone
    assert all_blocks_free(llm)


def test_sampled_forks_each_follow_the_grammar_and_a_seed_repeats_them(llm):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=120, structured_outputs=params)
    first, again = (llm.generate("A person as JSON:", sp, use_tqdm=False)[0] for _ in range(2))
    for c in first.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
        assert c.text == json.dumps(json.loads(c.text), ensure_ascii=False)   # no free whitespace
        assert _is_sentence(llm, params, list(c.token_ids))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


@pytest.mark.parametrize("bad,why", [
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json cannot be compiled"),
    (StructuredOutputsParams(regex="(("), "structured_outputs.regex cannot be compiled"),
    (StructuredOutputsParams(grammar="root ::= missing"), 'Rule "missing" is not defined'),
])
def test_a_constraint_that_cannot_compile_is_refused_and_nothing_is_lost(llm, bad, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        llm.generate("Hello", SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and all_blocks_free(llm)


NESTED = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 30},
                         "kind": {"enum": ["book", "film", "song"]},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                         "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                                     "alive": {"type": "boolean"}},
                                    "required": ["name", "alive"]},
                         "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "sci-fi"]},
                                    "minItems": 1, "maxItems": 3}},
          "required": ["title", "kind", "year", "author", "genres"]}


def test_every_seed_and_temperature_gives_output_the_constraint_accepts(llm):
    """Nested objects, enums, arrays and required fields; a choice; a regex: over 8 seeds at two
    temperatures each output validates / matches (outputs cut by max_tokens are prefixes: none here
    with these bounds)."""
    cases = [(StructuredOutputsParams(json=NESTED, disable_any_whitespace=True), "A work of fiction as JSON:"),
             (StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]), "Pick one:"),
             (StructuredOutputsParams(regex=r"(\+|-)?[0-9]{1,4}\.[0-9]{2}"), "A price:")]
    prompts, params = [], []
    for c, prompt in cases:
        for seed in range(8):
            for temperature in (0.7, 1.5):
                prompts.append(prompt)
                params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=150, structured_outputs=c))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(params, outs):
        c, text = p.structured_outputs, o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", (c.kind, text)
        if c.kind == "json":
            jsonschema.validate(json.loads(text), NESTED)
        elif c.kind == "choice":
            assert text in c.choice
        else:
            assert re.fullmatch(c.regex, text), text


def test_the_engines_mask_is_the_matchers_and_leaves_allowed_logits_as_they_are(llm):
    """After a prefix of tokens, the engine's bitmask for a request equals a fresh matcher's on the
    same tokens, the masked logits equal the raw ones wherever allowed, and a row without a
    constraint (all allowed) samples from exactly the raw logits."""
    params = StructuredOutputsParams(json=PERSON)
    tok = llm.engine.tokenizer
    prefix = tok.encode('{"name": "Ada", "ag', add_special_tokens=False)
    grammar = llm.engine.structured.grammar(params)
    fresh = _matcher(llm, params)
    for t in prefix:
        assert grammar.accept(t) and fresh.accept_token(t)
    vocab = llm.engine.model_config.vocab_size
    mask = llm.engine.structured.bitmask([grammar, None])
    want = new_bitmask(1, vocab)
    fresh.fill_next_token_bitmask(want, 0)
    assert torch.equal(mask[0], want[0]) and bool((mask[1] == -1).all())
    logits = torch.randn(2, vocab)
    out = apply_bitmask(logits.clone(), mask)
    allowed = out[0] > float("-inf")
    assert 0 < int(allowed.sum()) < vocab and torch.equal(out[0][allowed], logits[0][allowed])
    assert torch.equal(out[1], logits[1])


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsonschema": {}})
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match=r"structured_outputs.json is \d+ bytes; a constraint may be at most"):
        StructuredOutputsParams(json={"type": "object", "description": "x" * (1 << 20)})


def test_preemption_chunked_prefill_and_the_prefix_cache_keep_constrained_output_valid():
    """A pool that holds two of four sequences (recompute preemption) and 16-token prefill chunks:
    every output is a sentence of its grammar; a repeated prompt hits the prefix cache (the grammar
    does not change what is cached) and makes the same tokens."""
    small = LLM(kv_cache_memory="16MiB", max_model_len=320, max_num_batched_tokens=32, dtype="float32",
                enforce_eager=True)
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    prompts = [f"Person {i}. " + "A long description of a person, then the same person as JSON. " * 6
               for i in range(4)]   # no two share a block: four sequences' worth of blocks
    sp = SamplingParams(temperature=0.8, max_tokens=100, structured_outputs=params)
    outs = small.generate(prompts, [replace(sp, seed=s) for s in range(4)], use_tqdm=False)
    assert small.get_metrics()["num_preemptions"] > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        assert _is_sentence(small, params, list(o.outputs[0].token_ids))
    again = small.generate(prompts[0], replace(sp, seed=0), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert all_blocks_free(small)


def test_bitmask_sets_exactly_the_disallowed_logits_to_minus_infinity():
    vocab = 70   # three words, the last one partly past the vocabulary
    mask = new_bitmask(2, vocab)
    mask[0] = 0
    mask[0, 0] = 0b101            # row 0 allows tokens 0 and 2
    mask[0, 2] = 1 << 5           # and 69
    logits = torch.arange(2 * vocab, dtype=torch.float32).view(2, vocab)
    out = apply_bitmask(logits.clone(), mask)
    assert (out[0] > float("-inf")).nonzero().flatten().tolist() == [0, 2, 69]
    assert torch.equal(out[1], logits[1])
